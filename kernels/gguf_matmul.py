"""Matrix products and row gathers over GGUF weights kept as their raw blocks (gguf_blocks.py, gguf_dequant.py).

Three ways to compute x [M, K] @ W^T for W [N, K] held as blocks, chosen by the batch M (choose_method):
- `gemv` (M <= GEMV_MAX_BATCH, decode): a program takes BLOCK_N rows of W over all of K, decodes each
  tile in registers once and multiplies it with every row of x, one scale multiply per group of
  weights (plane_dot); W is read once per call.
- `fused` (larger M): a program takes BLOCK_M rows of x and BLOCK_N rows of W; each dequantized plane
  of a tile is multiplied with `tl.dot` in the model's dtype, accumulated in float32.
- `scratch` (M >= the device's `scratch_min_batch`, prefill; it takes precedence): W is dequantized
  into a scratch tensor in x's dtype (one layer at a time, so the scratch is one layer's size, and only
  for W of at most `scratch_max_weights`: an 8B model's FFN, not its output layer) and multiplied with
  torch.mm, whose tuned GEMM wins once the product is compute-bound.
`dequantize_rows` is the third kernel: rows of W (all, or gathered by index: embeddings) to a dense tensor.
The loops of gemv and fused over one program's rows of W (`gemv_tiles`, `dot_tiles`) are shared with the
fused mixture-of-experts kernels (fused_moe.py), which point them at one expert's rows.
Which of fused and scratch wins at which batch is measured on the GPU (scripts/bench_kernels.py); on the
CPU, where the kernels run only in Triton's interpreter, the thresholds are those of INTERPRETER below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from localserve.kernels.gguf_blocks import QuantFormat
from localserve.kernels.gguf_dequant import dequantize_plane, plane_codes, plane_dot
from localserve.kernels.rounding import cast_round_nearest

GEMV_MAX_BATCH = 4  # x rows a gemv program multiplies one dequantized tile with (unrolled)


@dataclass(frozen=True)
class Tiling:
    """How one kernel cuts W: weights per row in a tile (rounded to a power of two of whole blocks, never
    longer than the row needs) and rows of W per program."""

    tile_values: int
    rows: int


@dataclass(frozen=True)
class MatmulConfig:
    """Each kernel's tiling, and the batch from which `scratch` replaces `fused`, for one kind of device.
    With `fill_rows` > 0, rows per program grow (in powers of two, up to the matrix's) while a plane
    tile stays within that many weights."""

    gemv: Tiling
    fused: Tiling
    dequantize: Tiling
    scratch_min_batch: int
    scratch_max_weights: int
    fill_rows: int = 0

    def launch_shape(self, tiling: Tiling, fmt: QuantFormat, in_features: int, num_rows: int) -> tuple[int, int]:
        """(blocks per tile, rows of W per program) for a W of `num_rows` x `in_features`."""
        blocks_per_row = in_features // fmt.block_values
        tile_blocks = min(triton.next_power_of_2(max(1, tiling.tile_values // fmt.block_values)),
                          triton.next_power_of_2(blocks_per_row))
        rows = tiling.rows
        plane_values = tile_blocks * fmt.block_values // fmt.planes
        while self.fill_rows and rows < num_rows and 2 * rows * plane_values <= self.fill_rows:
            rows *= 2
        return tile_blocks, rows


# CUDA: tiles a program holds in registers without spilling on sm_80 / sm_90 (checked by compiling every
# kernel for those targets: scripts/compile_kernels.py), with many programs in flight so a matrix-vector
# product streams W from memory. The scratch threshold is where a bf16 GEMM turns compute-bound on the
# cards this targets, to be confirmed by scripts/bench_kernels.py, which times fused and scratch.
CUDA = MatmulConfig(gemv=Tiling(256, 16), fused=Tiling(128, 32), dequantize=Tiling(128, 32), scratch_min_batch=128,
                    scratch_max_weights=2**27)
# The interpreter runs a program as numpy operations on whole tiles, each costing tens of microseconds of
# Python besides its numpy work: few, large tiles (a whole row, as many rows as fit in 2**18 weights:
# larger ones were no faster, their arrays falling out of the CPU's caches). The scratch path from 2 rows
# of x on: its dequantization costs about what a gemv of one row costs there (a gemv of 4 rows, 1.6
# times that), and numpy's matmul little beside it.
INTERPRETER = MatmulConfig(gemv=Tiling(4096, 16), fused=Tiling(512, 64), dequantize=Tiling(4096, 16),
                           scratch_min_batch=2, scratch_max_weights=2**30, fill_rows=2**18)


def matmul_config(device: torch.device) -> MatmulConfig:
    """The configuration of `device` (a CPU tensor means Triton's interpreter)."""
    return CUDA if device.type == "cuda" else INTERPRETER


@triton.jit
def gemv_tiles(acc, x_ptr, stride_x, num_x_rows, row_starts, blocks_per_row, in_features,
               FORMAT: tl.constexpr, PLANES: tl.constexpr, BLOCK_VALUES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
               TILE_BLOCKS: tl.constexpr, GROUP: tl.constexpr, BATCH: tl.constexpr):
    """acc [BN, BATCH] plus BN rows of W times rows 0..BATCH-1 of x, over all of K: each tile decoded once,
    one scale multiply per group (plane_dot). row_starts [BN, 1]: pointers to the rows' first blocks;
    x_ptr: x's first row (rows num_x_rows.. read as zeros), stride_x elements apart."""
    batch = tl.arange(0, BATCH)
    for first_block in range(0, blocks_per_row, TILE_BLOCKS):
        tile = row_starts + first_block * BLOCK_BYTES
        for plane in tl.static_range(PLANES):
            codes, scale, offset, columns = plane_codes(tile, blocks_per_row - 1 - first_block, FORMAT, plane,
                                                        TILE_BLOCKS)
            columns = first_block * BLOCK_VALUES + columns
            for m in tl.static_range(BATCH):
                x_end = tl.where(num_x_rows > m, in_features, 0)  # a padding row of x reads as zeros
                x = tl.load(x_ptr + m * stride_x + columns, mask=columns < x_end, other=0.0).to(tl.float32)
                acc += tl.where(batch[None, :] == m, plane_dot(codes, scale, offset, x, GROUP)[:, None], 0.0)
    return acc


@triton.jit
def dot_tiles(acc, x_rows, x_ok, row_starts, blocks_per_row, in_features,
              FORMAT: tl.constexpr, PLANES: tl.constexpr, BLOCK_VALUES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
              TILE_BLOCKS: tl.constexpr, GROUP: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BM, BN] plus x [BM, K] @ W^T for BN rows of W, over all of K: each plane of a tile dequantized,
    then tl.dot in COMPUTE. x_rows [BM, 1]: pointers to the rows of x (x_ok [BM]: those that exist; the
    others read as zeros); row_starts [BN, 1]: pointers to W's rows' first blocks."""
    for first_block in range(0, blocks_per_row, TILE_BLOCKS):
        tile = row_starts + first_block * BLOCK_BYTES
        for plane in tl.static_range(PLANES):
            w, columns = dequantize_plane(tile, blocks_per_row - 1 - first_block, FORMAT, plane, TILE_BLOCKS, GROUP)
            columns = first_block * BLOCK_VALUES + columns
            x = tl.load(x_rows + columns[None, :], mask=x_ok[:, None] & (columns < in_features)[None, :], other=0.0)
            acc = tl.dot(x.to(COMPUTE), tl.trans(w.to(COMPUTE)), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations, model dtype
    w_ptr,  # [N, row_bytes] uint8 raw blocks
    out_ptr,  # [M, N] model dtype
    num_x_rows, num_w_rows, in_features, row_bytes, blocks_per_row,  # M, N, K, bytes and blocks per W row
    stride_x, stride_out,  # elements between rows of x / out
    FORMAT: tl.constexpr, PLANES: tl.constexpr, BLOCK_VALUES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    TILE_BLOCKS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    BATCH: tl.constexpr,  # a power of two >= M
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_w_rows
    row_starts = w_ptr + tl.minimum(rows, num_w_rows - 1).to(tl.int64)[:, None] * row_bytes  # rows past W: its last
    acc = gemv_tiles(tl.zeros((BLOCK_N, BATCH), tl.float32), x_ptr, stride_x, num_x_rows, row_starts, blocks_per_row,
                     in_features, FORMAT, PLANES, BLOCK_VALUES, BLOCK_BYTES, TILE_BLOCKS, GROUP, BATCH)
    batch = tl.arange(0, BATCH)
    out = out_ptr + batch[None, :] * stride_out + rows[:, None]
    tl.store(out, cast_round_nearest(acc, out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (batch < num_x_rows)[None, :])


@triton.jit
def _fused_kernel(
    x_ptr,  # [M, K] activations, model dtype
    w_ptr,  # [N, row_bytes] uint8 raw blocks
    out_ptr,  # [M, N] model dtype
    num_x_rows, num_w_rows, in_features, row_bytes, blocks_per_row, stride_x, stride_out,
    FORMAT: tl.constexpr, PLANES: tl.constexpr, BLOCK_VALUES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    TILE_BLOCKS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr,  # dtype of the tl.dot operands: the model's on a GPU, fp32 in the interpreter
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no TF32)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_w_rows
    row_starts = w_ptr + tl.minimum(rows, num_w_rows - 1).to(tl.int64)[:, None] * row_bytes  # rows past W: its last
    x_rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    x_ok = x_rows < num_x_rows
    acc = dot_tiles(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), x_ptr + x_rows.to(tl.int64)[:, None] * stride_x, x_ok,
                    row_starts, blocks_per_row, in_features, FORMAT, PLANES, BLOCK_VALUES, BLOCK_BYTES, TILE_BLOCKS,
                    GROUP, COMPUTE, DOT_PRECISION)
    out = out_ptr + x_rows.to(tl.int64)[:, None] * stride_out + rows[None, :]
    tl.store(out, cast_round_nearest(acc, out_ptr.dtype.element_ty), mask=x_ok[:, None] & row_ok[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr,  # [N, row_bytes] uint8 raw blocks
    index_ptr,  # [R] int64 rows of W to read (GATHER), else unused
    out_ptr,  # [R, K] (GATHER) or [N, K], model dtype
    num_out_rows, num_w_rows, row_bytes, blocks_per_row, stride_out,
    FORMAT: tl.constexpr, PLANES: tl.constexpr, BLOCK_VALUES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    TILE_BLOCKS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GATHER: tl.constexpr,
):
    out_rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = out_rows < num_out_rows
    if GATHER:
        rows = tl.load(index_ptr + out_rows, mask=out_ok, other=0)
    else:
        rows = out_rows.to(tl.int64)
    row_ok = (rows >= 0) & (rows < num_w_rows)  # an id outside W gives a zero row, and reads inside W
    first_block = tl.program_id(1) * TILE_BLOCKS
    tile = w_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * row_bytes + first_block * BLOCK_BYTES
    for plane in tl.static_range(PLANES):
        w, columns = dequantize_plane(tile, blocks_per_row - 1 - first_block, FORMAT, plane, TILE_BLOCKS, GROUP)
        columns = first_block * BLOCK_VALUES + columns
        out = out_ptr + out_rows.to(tl.int64)[:, None] * stride_out + columns[None, :]
        tl.store(out, cast_round_nearest(tl.where(row_ok[:, None], w, 0.0), out_ptr.dtype.element_ty),
                 mask=out_ok[:, None] & (columns < blocks_per_row * BLOCK_VALUES)[None, :])


def _check_blocks(blocks: torch.Tensor, fmt: QuantFormat, in_features: int) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError(f"{fmt.name} blocks must be a contiguous uint8 [rows, row_bytes] tensor, got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")
    if blocks.shape[1] != fmt.row_bytes(in_features):
        raise ValueError(f"{fmt.name} rows of {in_features} weights take {fmt.row_bytes(in_features)} bytes, "
                         f"the blocks have {blocks.shape[1]}")


def _format_args(fmt: QuantFormat, tile_blocks: int) -> dict:
    return dict(FORMAT=fmt.code, PLANES=fmt.planes, BLOCK_VALUES=fmt.block_values, BLOCK_BYTES=fmt.block_bytes,
                TILE_BLOCKS=tile_blocks, GROUP=fmt.group)


def dequantize_rows(blocks: torch.Tensor, fmt: QuantFormat, in_features: int, dtype: torch.dtype,
                    rows: torch.Tensor | None = None, config: MatmulConfig | None = None) -> torch.Tensor:
    """W [N, K] from its blocks [N, row_bytes] in `dtype`; with `rows` [R] (int), only those rows [R, K]
    (an embedding lookup). A row index outside W gives a row of zeros. `config`: the device's default."""
    _check_blocks(blocks, fmt, in_features)
    config = config or matmul_config(blocks.device)
    num_out_rows = blocks.shape[0] if rows is None else rows.numel()
    out = torch.empty(num_out_rows, in_features, dtype=dtype, device=blocks.device)
    if num_out_rows == 0 or blocks.shape[0] == 0:  # the kernel reads at least one row of W
        return out.zero_()
    tile_blocks, block_n = config.launch_shape(config.dequantize, fmt, in_features, num_out_rows)
    blocks_per_row = in_features // fmt.block_values
    index = blocks if rows is None else rows.reshape(-1).to(torch.int64)  # unused without GATHER
    grid = (triton.cdiv(num_out_rows, block_n), triton.cdiv(blocks_per_row, tile_blocks))
    _dequantize_kernel[grid](blocks, index, out, num_out_rows, blocks.shape[0], blocks.shape[1], blocks_per_row,
                             out.stride(0), BLOCK_N=block_n, GATHER=rows is not None, **_format_args(fmt, tile_blocks))
    return out


def choose_method(batch: int, num_weights: int, config: MatmulConfig) -> str:
    """'gemv', 'fused' or 'scratch' for `batch` rows of x and a W of `num_weights` (module docstring)."""
    if batch >= config.scratch_min_batch and num_weights <= config.scratch_max_weights:
        return "scratch"
    return "gemv" if batch <= GEMV_MAX_BATCH else "fused"


def quantized_matmul(x: torch.Tensor, blocks: torch.Tensor, fmt: QuantFormat, in_features: int,
                     method: str | None = None, config: MatmulConfig | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, for W [N, K] held as its raw blocks [N, row_bytes].

    `method`: 'gemv', 'fused' or 'scratch'; None chooses by the batch (choose_method). `config`: tile
    sizes, the device's default (MatmulConfig) unless given (benchmarks compare others).
    """
    _check_blocks(blocks, fmt, in_features)
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {in_features}")
    leading = x.shape[:-1]
    x = x.reshape(-1, in_features)
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_x_rows, num_w_rows = x.shape[0], blocks.shape[0]
    config = config or matmul_config(x.device)
    method = method or choose_method(num_x_rows, num_w_rows * in_features, config)
    if method == "scratch":
        weight = dequantize_rows(blocks, fmt, in_features, x.dtype, config=config)
        return (x @ weight.T).reshape(*leading, num_w_rows)
    out = torch.empty(num_x_rows, num_w_rows, dtype=x.dtype, device=x.device)
    if num_x_rows == 0 or num_w_rows == 0:
        return out.reshape(*leading, num_w_rows)
    common = (num_x_rows, num_w_rows, in_features, blocks.shape[1], in_features // fmt.block_values,
              x.stride(0), out.stride(0))
    if method == "gemv":
        if num_x_rows > GEMV_MAX_BATCH:
            raise ValueError(f"gemv takes at most {GEMV_MAX_BATCH} rows of x, got {num_x_rows}")
        tile_blocks, block_n = config.launch_shape(config.gemv, fmt, in_features, num_w_rows)
        _gemv_kernel[(triton.cdiv(num_w_rows, block_n),)](
            x, blocks, out, *common, BLOCK_N=block_n, BATCH=triton.next_power_of_2(num_x_rows),
            **_format_args(fmt, tile_blocks))
    elif method == "fused":
        block_m = min(64, max(16, triton.next_power_of_2(num_x_rows)))
        tile_blocks, block_n = config.launch_shape(config.fused, fmt, in_features, num_w_rows)
        grid = (triton.cdiv(num_w_rows, block_n), triton.cdiv(num_x_rows, block_m))
        _fused_kernel[grid](x, blocks, out, *common, BLOCK_M=block_m, BLOCK_N=block_n, **dot_operands(x),
                            **_format_args(fmt, tile_blocks))
    else:
        raise ValueError(f"unknown method {method!r}: gemv, fused or scratch")
    return out.reshape(*leading, num_w_rows)


def dot_operands(x: torch.Tensor) -> dict:
    """COMPUTE and DOT_PRECISION of a tl.dot kernel whose activations are `x`: the model's dtype on CUDA;
    float32 without TF32 for float32 x, and in Triton's interpreter, which runs tl.dot through numpy
    (no bf16 there)."""
    if x.device.type != "cuda" or x.dtype == torch.float32:
        return dict(COMPUTE=tl.float32, DOT_PRECISION="ieee")
    return dict(COMPUTE={torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype], DOT_PRECISION="tf32")
