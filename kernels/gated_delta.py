"""The gated delta rule on CUDA: our own fused recurrent kernel over state slots, and fla-core's chunked prefill.

Which code runs where (the torch forms in models/layers/gated_delta.py are the CPU path and the reference):

- `fused_recurrent_slots` (this module's Triton kernel): T tokens of N sequences, token by token, each
  sequence's state read from a slot of a state pool [slots, Hv, Dk, Dv] (or zeros) and the state after its
  T tokens written back to a slot of that pool, in place. With T = 1 it is the decode step of every
  recurrent layer; it never copies a state out of the pool, which matters because decode is bound by the
  state's traffic (Qwen3.6-35B-A3B: 32 x 128 x 128 fp32 = 2 MiB per sequence and layer, read and written
  once per token).
- `fla_chunked` : fla-core's `chunk_gated_delta_rule` (the chunked, tensor-core form) for prefill.

Why fla-core for the chunked prefill and our own kernel for decode (issue 37): fla-core 0.6.0 (MIT,
pure Python + Triton, requires only einops) installs and imports on a machine without a GPU with torch
2.13 / Triton 3.9, supports grouped value heads (Hv a multiple of Hk), an initial state, the final state,
L2-normalised q/k in the kernel, and is what vLLM's kernels derive from: a well-kept, tuned chunked form
we would otherwise write and tune ourselves. Its kernels cannot run under Triton's interpreter (its chunked
form's autotuner needs a GPU driver and, with one config forced, the interpreter refuses its code), so its
path is checked only on CUDA (gpu-marked tests, scripts/gpu_check.sh delta). Its one-token recurrent form
reads its initial states from a [N, Hv, Dk, Dv] tensor and returns new ones, without slot indices: that
would gather and scatter every state around each decode step, tripling the traffic that bounds decode,
so decode uses our own kernel, which reads and writes the pool's slots directly (and runs, and is tested,
under the interpreter). Without fla-core (not importable, or a Triton it does not support) the chunked
form falls back to the torch one (models/layers/gated_delta.py); fla's code is used as a library, never
copied.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

FLA_CHUNK_SIZES = (16, 32, 64)  # the chunk sizes fla's chunked gated delta rule takes
FLA_L2NORM_EPS = 1e-6  # the eps of fla's in-kernel L2 norm of q and k


@triton.jit
def _fused_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, states_ptr, read_ptr, write_ptr,
    num_tokens,
    q_seq, q_tok, q_head, k_seq, k_tok, k_head, v_seq, v_tok, v_head,
    g_seq, g_tok, beta_seq, beta_tok, o_seq, o_tok, o_head,
    scale, eps,
    GROUP: tl.constexpr, NUM_V_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
):
    """One (sequence, value head, block of BV value columns): the state's [Dk, BV] tile stays in registers
    over the sequence's tokens; read from slot read[n] (zeros when -1), written to slot write[n]."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    key_head = head // GROUP
    rows = tl.arange(0, BK)
    cols = v_block * BV + tl.arange(0, BV)
    row_ok = rows < DK
    col_ok = cols < DV
    tile_ok = row_ok[:, None] & col_ok[None, :]
    tile = rows[:, None] * DV + cols[None, :]

    read_slot = tl.load(read_ptr + seq)
    fresh = read_slot < 0
    head_offset = head.to(tl.int64) * DK * DV
    read_base = states_ptr + tl.maximum(read_slot, 0).to(tl.int64) * NUM_V_HEADS * DK * DV + head_offset
    state = tl.load(read_base + tile, mask=tile_ok, other=0.0).to(tl.float32)  # slot 0 stands in for -1
    state = tl.where(fresh, 0.0, state)

    seq64 = seq.to(tl.int64)
    q_base = q_ptr + seq64 * q_seq + key_head * q_head
    k_base = k_ptr + seq64 * k_seq + key_head * k_head
    v_base = v_ptr + seq64 * v_seq + head * v_head
    o_base = out_ptr + seq64 * o_seq + head * o_head
    g_base = g_ptr + seq64 * g_seq + head
    beta_base = beta_ptr + seq64 * beta_seq + head
    for t in range(num_tokens):
        q = tl.load(q_base + t * q_tok + rows, mask=row_ok, other=0.0).to(tl.float32)
        k = tl.load(k_base + t * k_tok + rows, mask=row_ok, other=0.0).to(tl.float32)
        v = tl.load(v_base + t * v_tok + cols, mask=col_ok, other=0.0).to(tl.float32)
        g = tl.load(g_base + t * g_tok).to(tl.float32)
        beta = tl.load(beta_base + t * beta_tok).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
        q = q * scale
        state = state * tl.exp(g)
        predicted = tl.sum(state * k[:, None], axis=0)
        correction = beta * (v - predicted)
        state = state + k[:, None] * correction[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(o_base + t * o_tok + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)

    write_slot = tl.load(write_ptr + seq).to(tl.int64)
    write_base = states_ptr + write_slot * NUM_V_HEADS * DK * DV + head_offset
    tl.store(write_base + tile, state.to(states_ptr.dtype.element_ty), mask=tile_ok)


def _value_block(num_seqs: int, v_heads: int, v_dim: int) -> int:
    """Columns of the state per program: 32 (a [128, 32] fp32 tile is 32 registers a thread at 4 warps),
    16 when fewer programs than about two per SM of a large GPU would run otherwise (decode at batch 1)."""
    block = min(32, triton.next_power_of_2(v_dim))
    if num_seqs * v_heads * triton.cdiv(v_dim, block) < 256:
        block = min(16, block)
    return block


def _check_slots(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 states: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor) -> None:
    if query.dim() != 4 or key.shape != query.shape:
        raise ValueError(f"query and key must both be [N, T, Hk, Dk]; got {tuple(query.shape)} and {tuple(key.shape)}")
    num_seqs, length, k_heads, k_dim = key.shape
    if value.dim() != 4 or value.shape[:2] != (num_seqs, length):
        raise ValueError(f"value must be [N={num_seqs}, T={length}, Hv, Dv]; got {tuple(value.shape)}")
    v_heads, v_dim = value.shape[2:]
    if v_heads % k_heads:
        raise ValueError(f"value heads ({v_heads}) must be a multiple of query/key heads ({k_heads})")
    for name, tensor in (("g", g), ("beta", beta)):
        if tensor.shape != (num_seqs, length, v_heads):
            raise ValueError(f"{name} must be [N, T, Hv] = {(num_seqs, length, v_heads)}; got {tuple(tensor.shape)}")
    if states.dim() != 4 or states.shape[1:] != (v_heads, k_dim, v_dim):
        raise ValueError(f"states must be [slots, Hv={v_heads}, Dk={k_dim}, Dv={v_dim}]; got {tuple(states.shape)}")
    if not states.is_contiguous():
        raise ValueError("states must be contiguous (a state cache's matrix tensor)")
    for name, slots in (("read_slots", read_slots), ("write_slots", write_slots)):
        if slots.shape != (num_seqs,) or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor [N={num_seqs}]; got {slots.dtype} "
                             f"{tuple(slots.shape)}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous (stride 1); got {tensor.stride()}")
    devices = {t.device for t in (query, key, value, g, beta, states, read_slots, write_slots)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def fused_recurrent_slots(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor, *, l2norm_qk: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The gated delta rule token by token for N sequences whose states live in a slot pool (Triton).

    query/key [N, T, Hk, Dk], value [N, T, Hv, Dv], g/beta [N, T, Hv] (g the log-decay), states [slots, Hv,
    Dk, Dv] (contiguous, fp32 as a state cache keeps them), read_slots/write_slots [N]: sequence n starts
    from states[read_slots[n]] (zeros when -1) and its state after its T tokens is written to
    states[write_slots[n]] (the same slot or another; no two sequences may write one slot, nor write a slot
    another one reads). Returns the output [N, T, Hv, Dv] in the value's dtype."""
    _check_slots(query, key, value, g, beta, states, read_slots, write_slots)
    num_seqs, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[2:]
    output = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    if num_seqs == 0 or length == 0:
        return output
    g, beta = g.contiguous(), beta.contiguous()
    block_v = _value_block(num_seqs, v_heads, v_dim)
    grid = (num_seqs, v_heads, triton.cdiv(v_dim, block_v))
    _fused_recurrent_kernel[grid](
        query, key, value, g, beta, output, states, read_slots, write_slots,
        length,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), output.stride(0), output.stride(1),
        output.stride(2),
        k_dim ** -0.5, eps,
        GROUP=v_heads // k_heads, NUM_V_HEADS=v_heads, DK=k_dim, DV=v_dim,
        BK=triton.next_power_of_2(k_dim), BV=block_v, L2NORM=l2norm_qk,
        num_warps=4,
    )
    return output


_fla_failure: list[str] = []  # why fla's chunked form was turned off in this process, once it failed


@functools.cache
def _import_fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - any failure to import means: use the torch form
        _fla_failure.append(f"fla-core does not import: {type(exc).__name__}: {exc}")
        return None
    return chunk_gated_delta_rule


def fla_chunk_function():
    """fla-core's chunk_gated_delta_rule, or None where fla-core does not import or failed once in this
    process (`disable_fla`). Imported on first use: its import warns on a machine without a GPU."""
    chunk = _import_fla_chunk()
    return None if _fla_failure else chunk


def disable_fla(exc: BaseException) -> None:
    """Turn fla's chunked form off for this process after it raised (a Triton it does not support, say):
    warns once; the chunked form then runs in torch."""
    _fla_failure.append(f"fla-core's chunked form failed: {type(exc).__name__}: {exc}")
    warnings.warn(f"{_fla_failure[-1][:500]}; the gated delta rule's chunked prefill runs in torch from now on",
                  RuntimeWarning, stacklevel=3)


def fla_chunked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, *, chunk_size: int, l2norm_qk: bool, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule through fla-core (CUDA only), in models/layers/gated_delta.py's layout and
    dtypes (its inputs already checked there): q/k/v in the value's dtype, g in fp32, the state in fp32.
    Returns (output [B, T, Hv, Dv] in the value's dtype, final state [B, Hv, Dk, Dv] fp32)."""
    chunk = fla_chunk_function()
    if chunk is None:
        raise RuntimeError("fla-core is not importable")
    if chunk_size not in FLA_CHUNK_SIZES:
        raise ValueError(f"fla's chunked form takes chunk_size in {FLA_CHUNK_SIZES}; got {chunk_size}")
    dtype = value.dtype
    in_kernel = l2norm_qk and eps == FLA_L2NORM_EPS
    if l2norm_qk and not in_kernel:  # fla's in-kernel norm has a fixed eps: normalise here instead
        query, key = (x * torch.rsqrt(x.float().square().sum(-1, keepdim=True) + eps) for x in (query, key))
    state = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    output, final = chunk(
        query.to(dtype).contiguous(), key.to(dtype).contiguous(), value.contiguous(),
        g.to(torch.float32).contiguous(), beta.to(dtype).contiguous(),
        scale=query.shape[-1] ** -0.5, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=in_kernel, chunk_size=chunk_size,
    )
    return output.to(dtype), final.to(torch.float32)
