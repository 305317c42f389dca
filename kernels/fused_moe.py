"""The fused mixture-of-experts product on CUDA: the routed experts of one layer (moe_experts.py), dense or
GGUF blocks, multiplied without gathering any expert's weights; moe_reference is what it must equal.

Two ways, chosen by the batch (choose_moe_method):
- `per_token` (decode): a program takes one (token, expert) pair and BLOCK_N rows of that expert's gate
  and up, as the GGUF gemv does (gemv_tiles), and writes glu(gate, up); then a program takes one token
  and BLOCK_N rows of `down` and sums its k experts, weighted, in registers. Each pair reads its expert's
  rows directly (llama.cpp's mul_mat_id vector path): two tokens that chose one expert read it twice,
  which costs nothing while few tokens share experts.
- `grouped` (larger batches): the (token, expert) pairs are sorted by expert and each expert's run padded
  to BLOCK_M (sort_by_expert); a program takes one run of BLOCK_M pairs, all of one expert, and BLOCK_N
  rows of its weights, and multiplies with tl.dot (dot_tiles), so an expert's weights are read once per
  run. The down products are weighted per pair and summed over each token's k pairs in float32.
Both decode blocks with gguf_dequant.py's planes (dense experts as gguf_blocks.DENSE_ROWS), with the tiles
of gguf_matmul's MatmulConfig (per_token: its gemv tiling, grouped: its fused one). Nothing syncs with
the host, so a step captures in a CUDA graph. An expert id outside 0..E-1 is refused on the CPU; on CUDA,
where checking it would sync, its pair contributes nothing and reads no weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from localserve.kernels.gguf_blocks import DENSE_ROWS
from localserve.kernels.gguf_matmul import CUDA, INTERPRETER, MatmulConfig, dot_operands, dot_tiles, gemv_tiles
from localserve.kernels.moe_experts import ACTIVATIONS, ExpertMatrix, Experts
from localserve.kernels.rounding import cast_round_nearest

METHODS = ("per_token", "grouped")


@dataclass(frozen=True)
class MoeConfig:
    """Tiles (per_token: tiles.gemv, grouped: tiles.fused), the largest batch that runs per token, the
    largest run of pairs per grouped program, and the grouped kernels' warps and pipeline stages."""

    tiles: MatmulConfig
    per_token_max_batch: int
    max_block_m: int
    # At runs of 64 pairs with 4 warps, Q6_K spilled on sm_90 and the K-quants' three stages of tl.dot
    # operands took up to 120 KiB of shared memory (over the 99 KiB of sm_86 / sm_89); 8 warps and two
    # stages: at most 207 registers, no spills, at most 84 KiB (tests/kernels/cuda_compile.py).
    grouped_warps: int = 8
    grouped_stages: int = 2


# CUDA: per token while a batch's pairs mostly fall on different experts (Qwen3-30B-A3B: 8 tokens choose
# 64 pairs of 128 experts, about 50 distinct), to be placed by scripts/bench_moe.py on a GPU. Runs of 64
# pairs on sm_90; before it (no wgmma: the tl.dot accumulators live in registers) Q2_K, Q5_K and Q6_K
# spilled at 64 on sm_89, and nothing does at 32 on sm_86 and sm_89.
CUDA_MOE = MoeConfig(CUDA, per_token_max_batch=8, max_block_m=64)
CUDA_MOE_BEFORE_SM90 = MoeConfig(CUDA, per_token_max_batch=8, max_block_m=32)
INTERPRETER_MOE = MoeConfig(INTERPRETER, per_token_max_batch=4, max_block_m=64)


def cuda_moe_config(compute_capability: int) -> MoeConfig:
    """The configuration of a CUDA device of this major compute capability (9: sm_90)."""
    return CUDA_MOE if compute_capability >= 9 else CUDA_MOE_BEFORE_SM90


def moe_config(device: torch.device) -> MoeConfig:
    """The configuration of `device` (a CPU tensor means Triton's interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_MOE
    return cuda_moe_config(torch.cuda.get_device_capability(device)[0])


def choose_moe_method(num_tokens: int, config: MoeConfig) -> str:
    """'per_token' or 'grouped' for a batch of `num_tokens` (module docstring)."""
    return "per_token" if num_tokens <= config.per_token_max_batch else "grouped"


@triton.jit
def _expert_rows(w_ptr, expert, rows, num_rows, expert_stride, row_stride):
    """[BN, 1] pointers to rows `rows` of expert `expert` (rows past the last read the last one)."""
    row = tl.minimum(rows, num_rows - 1).to(tl.int64)[:, None]
    return w_ptr + expert.to(tl.int64) * expert_stride + row * row_stride


@triton.jit
def _with_bias(acc, bias_ptr, expert, rows, num_rows, HAS_BIAS: tl.constexpr):
    """acc [BM, BN] plus row `expert` of a bias [E, num_rows] at `rows` [BN] (nothing without HAS_BIAS)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * num_rows + rows, mask=rows < num_rows, other=0.0
                       ).to(tl.float32)[None, :]
    return acc


@triton.jit
def _vector_product(x_row, x_rows_present, w_ptr, bias_ptr, expert, rows, num_rows, columns, expert_stride, row_stride,
                    LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BN]: rows `rows` of expert `expert`'s W [num_rows, columns] (+ bias) times the vector at x_row (zeros
    when x_rows_present is 0). LAYOUT: (FORMAT, PLANES, BLOCK_VALUES, BLOCK_BYTES, TILE_BLOCKS, GROUP)."""
    acc = gemv_tiles(tl.zeros((BLOCK_N, 1), tl.float32), x_row, 0, x_rows_present,
                     _expert_rows(w_ptr, expert, rows, num_rows, expert_stride, row_stride), columns // LAYOUT[2],
                     columns, LAYOUT[0], LAYOUT[1], LAYOUT[2], LAYOUT[3], LAYOUT[4], LAYOUT[5], 1)
    return tl.sum(_with_bias(tl.trans(acc), bias_ptr, expert, rows, num_rows, HAS_BIAS), 0)


@triton.jit
def _tile_product(x_rows, x_ok, w_ptr, bias_ptr, expert, rows, num_rows, columns, expert_stride, row_stride,
                  LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BM, BN]: the rows of x at x_rows [BM, 1] (x_ok: those that exist) times rows `rows` of expert
    `expert`'s W [num_rows, columns], transposed (+ bias), with tl.dot."""
    acc = dot_tiles(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), x_rows, x_ok,
                    _expert_rows(w_ptr, expert, rows, num_rows, expert_stride, row_stride), columns // LAYOUT[2],
                    columns, LAYOUT[0], LAYOUT[1], LAYOUT[2], LAYOUT[3], LAYOUT[4], LAYOUT[5], COMPUTE, DOT_PRECISION)
    return _with_bias(acc, bias_ptr, expert, rows, num_rows, HAS_BIAS)


@triton.jit
def _glu(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """The experts' activation (moe_experts.py), ACTIVATION its index in ACTIVATIONS: silu(gate) * up,
    GELU's tanh form times up (0.5 (1 + tanh z) = sigmoid(2 z)), or gpt-oss's clamped SwiGLU."""
    if ACTIVATION == 1:
        return gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    if ACTIVATION == 2:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate * tl.sigmoid(gate * alpha) * (up + 1.0)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _run(sorted_pairs_ptr, num_pairs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A grouped program's (pairs [BM] of its run, which of them are real, its rows [BN] of W)."""
    pairs = tl.load(sorted_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs, tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _token_gate_up_kernel(
    x_ptr,  # [T, H] activations, model dtype
    gate_ptr, up_ptr,  # [E, I, H] dense, or uint8 [E, I, row bytes] blocks
    gate_bias_ptr, up_bias_ptr,  # [E, I] (read only with GATE_BIAS / UP_BIAS)
    topk_ids_ptr,  # [T * k] the pairs' experts
    hidden_ptr,  # [T * k, I] out: glu(gate x, up x), model dtype
    num_experts, top_k, hidden_size, intermediate_size, stride_x,
    gate_expert_stride, gate_row_stride, up_expert_stride, up_row_stride,  # elements (bytes for blocks)
    GATE: tl.constexpr, UP: tl.constexpr,  # (FORMAT, PLANES, BLOCK_VALUES, BLOCK_BYTES, TILE_BLOCKS, GROUP)
    GATE_BIAS: tl.constexpr, UP_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    alpha, limit, ACTIVATION: tl.constexpr,  # the activation: _glu
):
    pair = tl.program_id(0)
    expert = tl.load(topk_ids_ptr + pair)
    if (expert < 0) | (expert >= num_experts):
        return  # contributes nothing: the down kernel skips the pair
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_x
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate = _vector_product(x_row, 1, gate_ptr, gate_bias_ptr, expert, rows, intermediate_size, hidden_size,
                           gate_expert_stride, gate_row_stride, GATE, GATE_BIAS, BLOCK_N)
    up = _vector_product(x_row, 1, up_ptr, up_bias_ptr, expert, rows, intermediate_size, hidden_size,
                         up_expert_stride, up_row_stride, UP, UP_BIAS, BLOCK_N)
    hidden = _glu(gate, up, alpha, limit, ACTIVATION)
    tl.store(hidden_ptr + pair.to(tl.int64) * intermediate_size + rows,
             cast_round_nearest(hidden, hidden_ptr.dtype.element_ty), mask=rows < intermediate_size)


@triton.jit
def _token_down_kernel(
    hidden_ptr,  # [T * k, I] glu(gate, up), model dtype
    down_ptr,  # [E, H, I] dense, or uint8 [E, H, row bytes] blocks
    down_bias_ptr,  # [E, H] (read only with DOWN_BIAS)
    topk_ids_ptr, topk_weights_ptr,  # [T * k]
    out_ptr,  # [T, H] out, model dtype
    num_experts, top_k, hidden_size, intermediate_size, stride_out, down_expert_stride, down_row_stride,
    DOWN: tl.constexpr, DOWN_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for choice in range(top_k):
        pair = token * top_k + choice
        expert = tl.load(topk_ids_ptr + pair)
        valid = (expert >= 0) & (expert < num_experts)
        expert = tl.where(valid, expert, 0)
        product = _vector_product(hidden_ptr + pair.to(tl.int64) * intermediate_size,
                                  tl.where(valid, 1, 0),  # an invalid pair's row is never written: read as zeros
                                  down_ptr, down_bias_ptr, expert, rows, hidden_size, intermediate_size,
                                  down_expert_stride, down_row_stride, DOWN, DOWN_BIAS, BLOCK_N)
        weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
        acc += tl.where(valid, weight * product, 0.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + rows, cast_round_nearest(acc, out_ptr.dtype.element_ty),
             mask=rows < hidden_size)


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr,  # [T, H] activations, model dtype
    gate_ptr, up_ptr,  # [E, I, H] dense, or uint8 [E, I, row bytes] blocks
    gate_bias_ptr, up_bias_ptr,  # [E, I] (read only with GATE_BIAS / UP_BIAS)
    sorted_pairs_ptr,  # [S] pairs t * k + j grouped by expert, each expert's run padded to BLOCK_M with T * k
    run_experts_ptr,  # [S / BLOCK_M] the expert of each run of BLOCK_M, -1 for the runs past the last
    hidden_ptr,  # [T * k, I] out: glu(gate x, up x), model dtype
    num_pairs, top_k, hidden_size, intermediate_size, stride_x,
    gate_expert_stride, gate_row_stride, up_expert_stride, up_row_stride,
    GATE: tl.constexpr, UP: tl.constexpr, GATE_BIAS: tl.constexpr, UP_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    alpha, limit, ACTIVATION: tl.constexpr,  # the activation: _glu
):
    expert = tl.load(run_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    pairs, pair_ok, rows = _run(sorted_pairs_ptr, num_pairs, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_x
    gate = _tile_product(x_rows, pair_ok, gate_ptr, gate_bias_ptr, expert, rows, intermediate_size, hidden_size,
                         gate_expert_stride, gate_row_stride, GATE, GATE_BIAS, BLOCK_M, BLOCK_N, COMPUTE,
                         DOT_PRECISION)
    up = _tile_product(x_rows, pair_ok, up_ptr, up_bias_ptr, expert, rows, intermediate_size, hidden_size,
                       up_expert_stride, up_row_stride, UP, UP_BIAS, BLOCK_M, BLOCK_N, COMPUTE, DOT_PRECISION)
    hidden = _glu(gate, up, alpha, limit, ACTIVATION)
    out = hidden_ptr + pairs.to(tl.int64)[:, None] * intermediate_size + rows[None, :]
    tl.store(out, cast_round_nearest(hidden, hidden_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & (rows < intermediate_size)[None, :])


@triton.jit
def _grouped_down_kernel(
    hidden_ptr,  # [T * k, I] glu(gate, up), model dtype
    down_ptr,  # [E, H, I] dense, or uint8 [E, H, row bytes] blocks
    down_bias_ptr,  # [E, H] (read only with DOWN_BIAS)
    topk_weights_ptr,  # [T * k]
    sorted_pairs_ptr, run_experts_ptr,  # as _grouped_gate_up_kernel's
    out_ptr,  # [T * k, H] out: each pair's weighted product, float32
    num_pairs, hidden_size, intermediate_size, down_expert_stride, down_row_stride,
    DOWN: tl.constexpr, DOWN_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    expert = tl.load(run_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    pairs, pair_ok, rows = _run(sorted_pairs_ptr, num_pairs, BLOCK_M, BLOCK_N)
    acc = _tile_product(hidden_ptr + pairs.to(tl.int64)[:, None] * intermediate_size, pair_ok, down_ptr,
                        down_bias_ptr, expert, rows, hidden_size, intermediate_size, down_expert_stride,
                        down_row_stride, DOWN, DOWN_BIAS, BLOCK_M, BLOCK_N, COMPUTE, DOT_PRECISION)
    weights = tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    out = out_ptr + pairs.to(tl.int64)[:, None] * hidden_size + rows[None, :]
    tl.store(out, acc * weights[:, None], mask=pair_ok[:, None] & (rows < hidden_size)[None, :])


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of topk_ids [T, k] (pair t * k + j) in runs of `block_m` that each belong to one expert:
    (sorted_pairs [S], each expert's pairs in order of t, its run padded to a multiple of block_m with
    T * k; run_experts [S / block_m], the expert of each run, -1 for the runs past the last). S is a bound
    known without looking at the ids (T * k plus block_m - 1 per expert that can be chosen), so nothing
    syncs with the host; an id outside 0..E-1 is left out."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    experts = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # num_experts: left out
    # Not torch.bincount: on CUDA it reads the largest id back to the host, which a CUDA graph cannot capture.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    run_ends = torch.cumsum(padded, 0)
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    destination = torch.where(sorted_experts < num_experts, (run_ends - padded)[sorted_experts] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, destination, order.to(torch.int32))
    run_starts = torch.arange(0, capacity, block_m, device=flat.device)
    run_experts = torch.searchsorted(run_ends[:num_experts], run_starts, right=True)
    run_experts = torch.where(run_experts < num_experts, run_experts, -1).to(torch.int32)
    return sorted_pairs[:capacity], run_experts


def _layout(matrix: ExpertMatrix, tiles: MatmulConfig, grouped: bool) -> tuple[tuple[int, ...], int]:
    """(the kernels' description of `matrix`'s rows: FORMAT, PLANES, BLOCK_VALUES, BLOCK_BYTES, TILE_BLOCKS,
    GROUP; rows of it per program)."""
    fmt = matrix.format or DENSE_ROWS
    tile_blocks, block_n = tiles.launch_shape(tiles.fused if grouped else tiles.gemv, fmt, matrix.columns,
                                              matrix.rows)
    return (fmt.code, fmt.planes, fmt.block_values, fmt.block_bytes, tile_blocks, fmt.group), block_n


def _strides(matrix: ExpertMatrix) -> tuple[int, int]:
    return matrix.data.stride(0), matrix.data.stride(1)


def _check(x: torch.Tensor, experts: Experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
           method: str | None) -> None:
    if method is not None and method not in METHODS:
        raise ValueError(f"unknown method {method!r}: {' or '.join(METHODS)}")
    if x.dim() != 2 or x.shape[1] != experts.hidden_size:
        raise ValueError(f"x must be [tokens, {experts.hidden_size}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, not {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [{x.shape[0]}, k >= 1] for x of {x.shape[0]} tokens, got "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, not {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point of topk_ids' shape {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    for name, matrix in (("gate", experts.gate), ("up", experts.up), ("down", experts.down)):
        tensors = [matrix.data] + ([] if matrix.bias is None else [matrix.bias])
        if any(tensor.device != x.device for tensor in tensors + [topk_ids, topk_weights]):
            raise ValueError(f"x, topk_ids, topk_weights and the {name} experts must be on one device")
        if matrix.data.stride(2) != 1 or (matrix.bias is not None and not matrix.bias.is_contiguous()):
            raise ValueError(f"the {name} experts' rows (and bias) must be contiguous")
        if matrix.format is None and matrix.data.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dense {name} experts must be bfloat16, float16 or float32, not {matrix.data.dtype}")
    if x.device.type != "cuda" and topk_ids.numel() and not (  # on CUDA this check would sync
            (topk_ids >= 0) & (topk_ids < experts.num_experts)).all():
        raise ValueError(f"topk_ids must be in 0..{experts.num_experts - 1}")


def fused_moe(x: torch.Tensor, experts: Experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
              method: str | None = None, config: MoeConfig | None = None) -> torch.Tensor:
    """x [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H] in x's dtype: for each token the sum over
    its k experts of weight * down_e(glu(gate_e x, up_e x)), as moe_reference.

    `method`: 'per_token' or 'grouped'; None chooses by the batch (choose_moe_method). `config`: the
    device's default (moe_config) unless given.
    """
    _check(x, experts, topk_ids, topk_weights, method)
    num_tokens, top_k = topk_ids.shape
    hidden_size, intermediate_size = experts.hidden_size, experts.intermediate_size
    config = config or moe_config(x.device)
    method = method or choose_moe_method(num_tokens, config)
    if num_tokens == 0:
        return torch.zeros(0, hidden_size, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    ids, weights = topk_ids.reshape(-1).contiguous(), topk_weights.reshape(-1).contiguous()
    gate, up, down = experts.gate, experts.up, experts.down
    gate_layout, gate_rows = _layout(gate, config.tiles, method == "grouped")
    up_layout, up_rows = _layout(up, config.tiles, method == "grouped")
    down_layout, down_rows = _layout(down, config.tiles, method == "grouped")
    block_n = min(gate_rows, up_rows)
    hidden = torch.empty(num_tokens * top_k, intermediate_size, dtype=x.dtype, device=x.device)
    # An absent bias is never read; the weights stand in for its pointer.
    biases = [m.data if m.bias is None else m.bias for m in (gate, up, down)]
    gate_up = dict(GATE=gate_layout, UP=up_layout, GATE_BIAS=gate.bias is not None, UP_BIAS=up.bias is not None,
                   alpha=float(experts.alpha), limit=float(experts.limit),
                   ACTIVATION=ACTIVATIONS.index(experts.activation))
    down_args = dict(DOWN=down_layout, DOWN_BIAS=down.bias is not None)
    if method == "per_token":
        _token_gate_up_kernel[(num_tokens * top_k, triton.cdiv(intermediate_size, block_n))](
            x, gate.data, up.data, biases[0], biases[1], ids, hidden, experts.num_experts, top_k, hidden_size,
            intermediate_size, x.stride(0), *_strides(gate), *_strides(up), BLOCK_N=block_n, **gate_up)
        out = torch.empty(num_tokens, hidden_size, dtype=x.dtype, device=x.device)
        _token_down_kernel[(num_tokens, triton.cdiv(hidden_size, down_rows))](
            hidden, down.data, biases[2], ids, weights, out, experts.num_experts, top_k, hidden_size,
            intermediate_size, out.stride(0), *_strides(down), BLOCK_N=down_rows, **down_args)
        return out
    num_pairs = num_tokens * top_k
    block_m = min(config.max_block_m, max(16, triton.next_power_of_2(triton.cdiv(num_pairs, experts.num_experts))))
    sorted_pairs, run_experts = sort_by_expert(topk_ids, experts.num_experts, block_m)
    operands = dot_operands(x) | dict(num_warps=config.grouped_warps, num_stages=config.grouped_stages)
    _grouped_gate_up_kernel[(run_experts.numel(), triton.cdiv(intermediate_size, block_n))](
        x, gate.data, up.data, biases[0], biases[1], sorted_pairs, run_experts, hidden, num_pairs, top_k,
        hidden_size, intermediate_size, x.stride(0), *_strides(gate), *_strides(up), BLOCK_M=block_m,
        BLOCK_N=block_n, **gate_up, **operands)
    weighted = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=x.device)  # left-out pairs: 0
    _grouped_down_kernel[(run_experts.numel(), triton.cdiv(hidden_size, down_rows))](
        hidden, down.data, biases[2], weights, sorted_pairs, run_experts, weighted, num_pairs, hidden_size,
        intermediate_size, *_strides(down), BLOCK_M=block_m, BLOCK_N=down_rows, **down_args, **operands)
    return weighted.view(num_tokens, top_k, hidden_size).sum(1).to(x.dtype)
