"""The gated delta rule (the linear-attention mixer of Qwen3-Next / Qwen3.5 hybrid layers), in plain torch.

Per value head the recurrent state S is a [Dk, Dv] matrix. For each token t, with the query scaled by
Dk ** -0.5 (after an optional L2 normalisation of query and key), the decay a_t = exp(g_t) (g is the
log-decay, <= 0) and the write strength beta_t in [0, 1]:

    S <- a_t * S                                  (forget)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T     (delta rule: write the correction of what S predicts for k_t)
    o_t = S^T q_t

Shapes (the checkpoint's layout, as in transformers' Qwen3-Next):
    query, key: [B, T, Hk, Dk]; value: [B, T, Hv, Dv] with Hv a multiple of Hk (query/key head h serves the
    value heads h * Hv/Hk ... (h+1) * Hv/Hk - 1); g, beta: [B, T, Hv]; state: [B, Hv, Dk, Dv].
The output is [B, T, Hv, Dv] in the value's dtype; the final state is in the compute dtype: fp32, or fp64
for fp64 inputs. `recurrent_gated_delta_rule` goes one token at a time (decode, and the reference);
`chunked_gated_delta_rule` does the same in blocks of `chunk_size` tokens (prefill) and agrees with it to
rounding for any length and any initial state, so a prompt prefilled piece by piece (carrying the state)
gives the same result as in one pass.

On CUDA (backend "auto") the same functions run kernels (localserve.kernels.gated_delta, whose docstring
says which and why): the recurrent form and the slot-based `recurrent_gated_delta_rule_slots` (decode:
states read from and written to a state pool's slots in place) our own Triton kernel; the chunked form
fla-core's chunked kernel where fla-core imports, else the torch form here. fp64 inputs and CPU tensors
take the torch forms. `backend` forces one: "torch", "triton" (our recurrent kernel; for the chunked form
too, token by token), "fla" (chunked form only).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Backend = Literal["auto", "torch", "triton", "fla"]
BACKENDS = ("auto", "torch", "triton", "fla")


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           initial_state: torch.Tensor | None) -> None:
    if query.dim() != 4 or key.shape != query.shape:
        raise ValueError(f"query and key must both be [B, T, Hk, Dk]; got {tuple(query.shape)} and {tuple(key.shape)}")
    batch, length, k_heads, k_dim = key.shape
    if length < 1:
        raise ValueError("the sequence must hold at least one token (T >= 1)")
    if value.dim() != 4 or value.shape[:2] != (batch, length):
        raise ValueError(f"value must be [B={batch}, T={length}, Hv, Dv]; got {tuple(value.shape)}")
    v_heads, v_dim = value.shape[2:]
    if v_heads % k_heads:
        raise ValueError(f"value heads ({v_heads}) must be a multiple of query/key heads ({k_heads})")
    for name, tensor in (("g", g), ("beta", beta)):
        if tensor.shape != (batch, length, v_heads):
            raise ValueError(f"{name} must be [B, T, Hv] = {(batch, length, v_heads)}; got {tuple(tensor.shape)}")
    if initial_state is not None and initial_state.shape != (batch, v_heads, k_dim, v_dim):
        raise ValueError(f"initial_state must be [B, Hv, Dk, Dv] = {(batch, v_heads, k_dim, v_dim)}; "
                         f"got {tuple(initial_state.shape)}")


def _prepare(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             initial_state: torch.Tensor | None, l2norm_qk: bool, eps: float):
    """Checks the inputs; returns q, k, v [B, Hv, T, D], g, beta [B, Hv, T] and the state, in the compute
    dtype, with q scaled (and q, k normalised where asked) and the key heads repeated over their value heads."""
    _check(query, key, value, g, beta, initial_state)
    dtype = torch.promote_types(value.dtype, torch.float32)
    batch, _, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[2:]
    query, key = (x.to(dtype).repeat_interleave(v_heads // k_heads, dim=2) for x in (query, key))
    if l2norm_qk:
        query, key = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps) for x in (query, key))
    query = query * k_dim ** -0.5
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (query, key, value))
    g, beta = (x.to(dtype).transpose(1, 2) for x in (g, beta))
    state = (torch.zeros(batch, v_heads, k_dim, v_dim, dtype=dtype, device=value.device) if initial_state is None
             else initial_state.to(dtype))
    return q, k, v, g, beta, state


def recurrent_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, *, l2norm_qk: bool = False, eps: float = 1e-6,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (module docstring: shapes, dtypes, backends). Returns (output,
    final state)."""
    if _backend(value, backend, chunked=False) == "triton":
        _check(query, key, value, g, beta, initial_state)
        batch, _, v_heads, v_dim = value.shape
        states = (torch.zeros(batch, v_heads, key.shape[-1], v_dim, dtype=torch.float32, device=value.device)
                  if initial_state is None else initial_state.to(torch.float32).contiguous().clone())
        slots = torch.arange(batch, device=value.device)
        output = _fused_recurrent()(query, key, value, g, beta, states, slots, slots, l2norm_qk=l2norm_qk, eps=eps)
        return output, states
    q, k, v, g, beta, state = _prepare(query, key, value, g, beta, initial_state, l2norm_qk, eps)
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        correction = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t, :, None] * correction[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    output = torch.stack(outputs, dim=1)
    return output.to(value.dtype), state


def chunked_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, *, chunk_size: int = 64, l2norm_qk: bool = False,
    eps: float = 1e-6, backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in blocks of `chunk_size` tokens (module docstring: shapes, dtypes).

    Inside a chunk, with c_t the log-decay summed from the chunk's start to t and S0 the state entering it,
    the rows written u_s = beta_s (v_s - a_s S_{s-1}^T k_s) satisfy the unit lower-triangular system
    u_s + sum_{r<s} beta_s e^(c_s - c_r) (k_s . k_r) u_r = beta_s v_s - beta_s e^(c_s) S0^T k_s,
    solved once for all chunks; then o_t = e^(c_t) S0^T q_t + sum_{r<=t} e^(c_t - c_r) (q_t . k_r) u_r and
    the state leaving the chunk is e^(c_end) S0 + sum_r e^(c_end - c_r) k_r u_r^T: only this part is
    sequential. The last chunk is padded with tokens that neither decay (g = 0) nor write (k = 0, beta = 0).
    Returns (output, final state)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1; got {chunk_size}")
    chosen = _backend(value, backend, chunked=True, chunk_size=chunk_size)
    if chosen == "triton":
        return recurrent_gated_delta_rule(query, key, value, g, beta, initial_state, l2norm_qk=l2norm_qk, eps=eps,
                                          backend="triton")
    if chosen == "fla":
        from localserve.kernels.gated_delta import disable_fla, fla_chunked

        _check(query, key, value, g, beta, initial_state)
        try:
            return fla_chunked(query, key, value, g, beta, initial_state, chunk_size=chunk_size,
                               l2norm_qk=l2norm_qk, eps=eps)
        except Exception as exc:  # noqa: BLE001 - auto falls back to torch (warned once); a forced fla raises
            if backend == "fla":
                raise
            disable_fla(exc)
    q, k, v, g, beta, state = _prepare(query, key, value, g, beta, initial_state, l2norm_qk, eps)
    length = q.shape[2]
    pad = -length % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    batch, heads, padded, _ = q.shape
    chunks = padded // chunk_size
    q, k, v = (x.reshape(batch, heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, chunks, chunk_size) for x in (g, beta))

    cum = g.cumsum(-1)  # c_t, <= 0
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # e^(c_t - c_r) for r <= t, 0 above the diagonal (masked before exp: the exponent there is positive)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    beta_col = beta[..., None]
    system = torch.eye(chunk_size, dtype=q.dtype, device=q.device) + (
        beta_col * decay * (k @ k.transpose(-1, -2))).tril(-1)
    # u = written_values - state_keys @ S0, both solved for every chunk at once
    written_values = torch.linalg.solve_triangular(system, beta_col * v, upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, beta_col * cum.exp()[..., None] * k, upper=False,
                                               unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_read = q * cum.exp()[..., None]
    end = cum[..., -1:]
    k_write = k * (end - cum).exp()[..., None]
    end_decay = end.exp()[..., None]

    outputs = []
    for c in range(chunks):
        u = written_values[:, :, c] - state_keys[:, :, c] @ state
        outputs.append(q_read[:, :, c] @ state + scores[:, :, c] @ u)
        state = state * end_decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ u
    output = torch.cat(outputs, dim=2)[:, :, :length].transpose(1, 2)
    return output.to(value.dtype), state


def recurrent_gated_delta_rule_slots(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor, *, l2norm_qk: bool = False,
    eps: float = 1e-6, backend: Backend = "auto",
) -> torch.Tensor:
    """The gated delta rule token by token for N sequences whose states live in a state pool (decode).

    query/key [N, T, Hk, Dk], value [N, T, Hv, Dv], g/beta [N, T, Hv] as above; `states` [slots, Hv, Dk, Dv]
    (a RecurrentStateCache's matrix tensor of one layer); sequence n starts from states[read_slots[n]]
    (zeros when -1) and its state after its T tokens is written to states[write_slots[n]], in place (no two
    sequences may write one slot, nor write a slot another one reads). Returns the output [N, T, Hv, Dv] in
    the value's dtype. On CUDA one Triton kernel does it all without copying states out of the pool."""
    if _backend(value, backend, chunked=False) == "triton":
        return _fused_recurrent()(query, key, value, g, beta, states, read_slots, write_slots,
                                  l2norm_qk=l2norm_qk, eps=eps)
    if read_slots.shape != (query.shape[0],) or write_slots.shape != (query.shape[0],):
        raise ValueError(f"read_slots and write_slots must be [N={query.shape[0]}]; got {tuple(read_slots.shape)} "
                         f"and {tuple(write_slots.shape)}")
    fresh = (read_slots < 0).view(-1, 1, 1, 1)
    initial = states[read_slots.clamp(min=0)].masked_fill(fresh, 0)
    output, final = recurrent_gated_delta_rule(query, key, value, g, beta, initial, l2norm_qk=l2norm_qk, eps=eps,
                                               backend="torch")
    states.index_copy_(0, write_slots.to(torch.int64), final.to(states.dtype))
    return output


def _fused_recurrent():
    from localserve.kernels.gated_delta import fused_recurrent_slots

    return fused_recurrent_slots


def _backend(value: torch.Tensor, backend: str, *, chunked: bool, chunk_size: int = 64) -> str:
    """The backend that runs: "torch", "triton" or "fla" (module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "fla" and not chunked:
        raise ValueError("the fla backend runs only the chunked form")
    if backend != "auto":
        return backend
    if value.device.type != "cuda" or value.dtype == torch.float64:
        return "torch"
    if not chunked:
        return "triton"
    from localserve.kernels.gated_delta import FLA_CHUNK_SIZES, fla_chunk_function

    return "fla" if chunk_size in FLA_CHUNK_SIZES and fla_chunk_function() is not None else "torch"
