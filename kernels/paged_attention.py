"""paged_attention: one kernel for a mixed batch (decode rows and chunked-prefill rows) over the paged pool.

A program takes one query tile of one sequence and one KV head: the tile's rows are (query, head) pairs
of that KV head's query heads, so each K/V tile is loaded once for the whole group (9:3 included: rows
need not be a power of two per query). It walks the sequence's keys through its block table in tiles
of BLOCK_N, dequantizes them in the load (every K and V format, K and V independently), masks causally
inside a chunk (or up to each row's key limit: a bidirectional image span's tokens see the whole span), and
keeps an online softmax. With SPLIT_KV the keys of each tile are divided among the
programs of the grid's third dimension, which write partial outputs and log-sum-exps that
`_merge_splits_kernel` combines; the split count is a run-time value, so it never costs a recompile.
Offsets into the pool are 64-bit. The plan (which tile is whose) comes from attention_plan.py.

Per-layer geometry: a sliding window W (a run-time value; none: WINDOW_NONE) starts a tile's key loop at
the key tile holding the first key its first query sees and masks the keys before each row's window, so
a decode costs O(W) and no block-table entry wholly before the window is read (it may be -1); the
splits divide only the tiles the window covers. Sinks (a logit per query head, in log2 units) join the
denominator once: at the end of an unsplit program, or in the merge, never in a split. A soft-cap
squashes the scaled logits (cap * tanh(s / cap)) before the softmax. A layer whose keys are its values
passes its key store as its value store (attention_backend does).

4-bit means: a key's mean term q . E rope(mu, p) is a sum over frequency pairs of per-query
coefficients (M q, computed once per layer by the caller) times cos / sin of the key position, so it is
one extra [rows, D] x [D, keys] product per tile; the value mean is position-independent, so only the
softmax weight of the keys that use it is accumulated and the mean is added once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from localserve.kernels.attention_plan import AttentionPlan
from localserve.kernels.kv_format import PLAIN, Q4, Q8_0, KernelFormat, KVStore
from localserve.kernels.rounding import cast_round_nearest

LOG2E = 1.4426950408889634
MEAN_SLICE = 32  # dims per slice of the 4-bit key mean's fp32 product (see _paged_attention_kernel)
WINDOW_NONE = 1 << 30  # the window of a layer without one: longer than any context
# The format ids as kernel code reads them: compiled (not interpreted) kernels may read only
# tl.constexpr globals.
PLAIN_CODE, Q8_0_CODE, Q4_CODE = tl.constexpr(PLAIN), tl.constexpr(Q8_0), tl.constexpr(Q4)


@triton.jit
def load_kv_tile(data_ptr, scales_ptr, levels_ptr, row, valid, FORMAT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Tile [N, D] of vectors `row` [N] (int64 index of (slot, KV head)) and, for Q4, |scale| and the mean bit.

    PLAIN returns the stored dtype, Q8_0 the dequantized fp32 values, Q4 the levels (the scale applies
    per key, so the caller folds it into the scores or the softmax weights instead of into D values).
    """
    dims = tl.arange(0, HEAD_DIM)
    magnitude = tl.zeros(row.shape, tl.float32)
    uses_mean = tl.zeros(row.shape, tl.int1)
    if FORMAT == PLAIN_CODE:
        tile = tl.load(data_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
    elif FORMAT == Q8_0_CODE:
        codes = tl.load(data_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0)
        scales = tl.load(scales_ptr + row[:, None] * (HEAD_DIM // 32) + (dims // 32)[None, :],
                         mask=valid[:, None], other=0.0)
        tile = codes.to(tl.float32) * scales.to(tl.float32)
    else:
        packed = tl.load(data_ptr + row[:, None] * (HEAD_DIM // 2) + (dims // 2)[None, :],
                         mask=valid[:, None], other=0)
        codes = (packed >> ((dims % 2) * 4).to(tl.uint8)[None, :]) & 0xF
        tile = tl.load(levels_ptr + codes.to(tl.int32))
        scale = tl.load(scales_ptr + row, mask=valid, other=0.0)
        magnitude = tl.abs(scale.to(tl.float32))
        uses_mean = scale.to(tl.int16, bitcast=True) < 0  # the sign bit: -0.0 counts
    return tile, magnitude, uses_mean


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [T, H, D] query in the key store's domain, model dtype
    out_ptr,  # [T, H, D] model dtype (without SPLIT_KV)
    partial_out_ptr,  # [T, H, S, D] fp32, S = the grid's third size: the splits (SPLIT_KV)
    partial_lse_ptr,  # [T, H, S] fp32, log2 of each split's softmax denominator plus its max (SPLIT_KV)
    k_data_ptr, k_scales_ptr, k_levels_ptr,  # key store (see kv_format.py) and its [16] levels (Q4)
    v_data_ptr, v_scales_ptr, v_levels_ptr,  # value store and its levels
    key_coeff_ptr,  # [T, H, D] fp32 per-query coefficients of the 4-bit key mean (KEY_MEAN)
    trig_ptr,  # [P, D] fp32 cos | sin halves at positions 0..P-1, P >= the longest context (KEY_MEAN)
    value_mean_ptr,  # [Hkv, D] fp32 stored-domain value mean (VALUE_MEAN)
    sinks_ptr,  # [H] fp32 sink logit of each query head times log2(e) (SINKS, unsplit)
    tile_count_ptr,  # [num_tiles, Hkv, splits] int32 key tiles each program visited (COUNT_TILES)
    block_table_ptr,  # [S, max_blocks] int32
    query_start_ptr,  # [S + 1] int32 first query token of each sequence in the batch
    seq_len_ptr,  # [S] int32 context length of each sequence, its new tokens included
    tile_seq_ptr,  # [num_tiles] int32 sequence of each query tile; -1: a padding tile
    tile_start_ptr,  # [num_tiles] int32 first query of each tile within its sequence's new tokens
    key_limit_ptr,  # [T] int32 last key position each query token sees (KEY_LIMITS)
    qk_scale,  # float: softmax scale * log2(e)
    window,  # int: each query sees its last `window` keys (WINDOW_NONE: all of them)
    softcap_scale, softcap_log2,  # floats: 2 * log2(e) * scale / cap and cap * log2(e) (SOFTCAP)
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,  # elements; the last stride is 1
    stride_table,  # elements between block-table rows
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    QUERIES_PER_TILE: tl.constexpr,  # BLOCK_M // GROUP
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr,  # the keys are divided among the grid's third dimension, merged afterwards
    K_FORMAT: tl.constexpr, V_FORMAT: tl.constexpr, KEY_MEAN: tl.constexpr, VALUE_MEAN: tl.constexpr,
    COMPUTE: tl.constexpr,  # dtype of the tl.dot operands: the model's on a GPU, fp32 in the interpreter
    DOT_PRECISION: tl.constexpr,  # "ieee" when COMPUTE is fp32 (no TF32), else the backend's default
    SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
    MEAN_SLICE: tl.constexpr,  # dims of the head per slice of the 4-bit key mean's product
    COUNT_TILES: tl.constexpr,  # record the key tiles each program visits (tests: a window's cost)
    KEY_LIMITS: tl.constexpr,  # rows see keys up to their key_limit entry, not their own position
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq = tl.load(tile_seq_ptr + tile)
    if seq < 0:
        return
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_len_ptr + seq)
    tile_start = tl.load(tile_start_ptr + tile)

    rows = tl.arange(0, BLOCK_M)
    query_index = tile_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < QUERIES_PER_TILE * GROUP) & (query_index < query_len)
    token = (query_start + query_index).to(tl.int64)
    query_pos = seq_len - query_len + query_index  # causal: row sees keys 0..query_pos
    dims = tl.arange(0, HEAD_DIM)
    query = tl.load(query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                    mask=row_valid[:, None], other=0.0).to(COMPUTE)
    coeff_row = (token * NUM_HEADS + head) * HEAD_DIM  # of the 4-bit key mean's coefficients (KEY_MEAN)

    last_query = tl.minimum(tile_start + QUERIES_PER_TILE, query_len) - 1
    kv_end = seq_len - query_len + last_query + 1  # keys the tile's last query sees
    last_key = query_pos
    if KEY_LIMITS:  # a bidirectional span's rows see its later keys: the tile reads to its rows' furthest
        last_key = tl.load(key_limit_ptr + token, mask=row_valid, other=0)
        kv_end = tl.max(tl.where(row_valid, last_key, 0), 0) + 1
    # The first key the tile's first query sees: the tiles before it are skipped, and keys before it
    # never loaded (their blocks may be gone).
    kv_start = tl.maximum(seq_len - query_len + tile_start - window + 1, 0)
    # (a + b - 1) // b rather than tl.cdiv: a nested jit call is slow in Triton's interpreter.
    num_key_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    window_tile = kv_start // BLOCK_N
    tiles_per_split = (num_key_tiles - window_tile + num_splits - 1) // num_splits
    first_tile = window_tile + split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, num_key_tiles)
    if COUNT_TILES:
        tl.store(tile_count_ptr + (tile * NUM_KV_HEADS + kv_head) * num_splits + split,
                 tl.maximum(end_tile - first_tile, 0))

    # A finite floor for the running max: fully masked rows then give exp2(-inf - floor) = 0, never NaN.
    running_max = tl.full([BLOCK_M], -1.0e30, tl.float32)
    denominator = tl.zeros([BLOCK_M], tl.float32)
    mean_weight = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table
    for key_tile in range(first_tile, end_tile):
        keys = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = (keys < kv_end) & (keys >= kv_start)
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_row = (block * BLOCK_SIZE + keys % BLOCK_SIZE) * NUM_KV_HEADS + kv_head  # 64-bit from here on

        key, key_scale, key_uses_mean = load_kv_tile(k_data_ptr, k_scales_ptr, k_levels_ptr, kv_row, key_valid,
                                                     K_FORMAT, HEAD_DIM)
        scores = tl.dot(query, tl.trans(key.to(COMPUTE)), input_precision=DOT_PRECISION)
        if K_FORMAT == Q4_CODE:
            scores = scores * key_scale[None, :]
        if KEY_MEAN:  # an fp32 product by slices of the head: a whole [rows, D] x [D, keys] one spills
            mean_scores = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for start in tl.static_range(0, HEAD_DIM, MEAN_SLICE):
                part = start + tl.arange(0, MEAN_SLICE)
                coeff = tl.load(key_coeff_ptr + coeff_row[:, None] + part[None, :], mask=row_valid[:, None],
                                other=0.0)
                trig = tl.load(trig_ptr + keys.to(tl.int64)[:, None] * HEAD_DIM + part[None, :],
                               mask=key_valid[:, None], other=0.0)
                mean_scores = tl.dot(coeff, tl.trans(trig), mean_scores, input_precision="ieee")
            scores += tl.where(key_uses_mean[None, :], mean_scores, 0.0)
        visible = row_valid[:, None] & key_valid[None, :] & (keys[None, :] <= last_key[:, None])
        visible &= keys[None, :] > query_pos[:, None] - window
        if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (e^2x + 1): +-1 at either end, never NaN
            squashed = 1.0 - 2.0 / (tl.exp2(scores * softcap_scale) + 1.0)
            scores = tl.where(visible, squashed * softcap_log2, float("-inf"))
        else:
            scores = tl.where(visible, scores * qk_scale, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        denominator = denominator * rescale + tl.sum(weights, 1)
        value, value_scale, value_uses_mean = load_kv_tile(v_data_ptr, v_scales_ptr, v_levels_ptr, kv_row,
                                                           key_valid, V_FORMAT, HEAD_DIM)
        if VALUE_MEAN:
            mean_weight = mean_weight * rescale + tl.sum(tl.where(value_uses_mean[None, :], weights, 0.0), 1)
        if V_FORMAT == Q4_CODE:
            weights = weights * value_scale[None, :]
        acc = acc * rescale[:, None] + tl.dot(weights.to(COMPUTE), value.to(COMPUTE), input_precision=DOT_PRECISION)
        running_max = new_max

    if VALUE_MEAN:
        acc += mean_weight[:, None] * tl.load(value_mean_ptr + kv_head * HEAD_DIM + dims)[None, :]
    if SINKS and not SPLIT_KV:  # the sink joins the denominator once; a split's merge adds it instead
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0)
        new_max = tl.maximum(running_max, sink)
        rescale = tl.exp2(running_max - new_max)
        denominator = denominator * rescale + tl.exp2(sink - new_max)
        acc = acc * rescale[:, None]
        running_max = new_max
    output = acc / tl.where(denominator > 0, denominator, 1.0)[:, None]
    if not SPLIT_KV:
        tl.store(out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
                 cast_round_nearest(output, out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        partial_row = (token * NUM_HEADS + head) * num_splits + split
        tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :], output, mask=row_valid[:, None])
        has_keys = denominator > 0
        lse = tl.where(has_keys, running_max + tl.log2(tl.where(has_keys, denominator, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,  # [T, H, S, D] fp32
    partial_lse_ptr,  # [T, H, S] fp32 (log2)
    out_ptr,  # [T, H, D] model dtype
    num_tokens_ptr,  # [1] int32 real tokens of the batch (the rest of T is padding, left unwritten)
    sinks_ptr,  # [H] fp32 sink logit of each query head times log2(e) (SINKS)
    num_splits,  # S
    stride_o_token, stride_o_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,  # powers of two >= NUM_HEADS, >= S
    SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if token >= tl.load(num_tokens_ptr):
        return
    heads = tl.arange(0, BLOCK_H)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    lse_rows = partial_lse_ptr + (token * NUM_HEADS + heads) * num_splits
    lse_mask = (heads < NUM_HEADS)[:, None] & (splits < num_splits)[None, :]
    lse = tl.load(lse_rows[:, None] + splits[None, :], mask=lse_mask, other=float("-inf"))
    max_lse = tl.max(lse, 1)
    if SINKS:  # each head's sink, once for all its splits
        sink = tl.load(sinks_ptr + heads, mask=heads < NUM_HEADS, other=float("-inf"))
        max_lse = tl.maximum(max_lse, sink)
    max_lse = tl.where(max_lse == float("-inf"), 0.0, max_lse)
    total = tl.sum(tl.exp2(lse - max_lse[:, None]), 1)
    if SINKS:
        total += tl.exp2(sink - max_lse)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for split in range(num_splits):
        weight = tl.exp2(tl.load(lse_rows + split, mask=heads < NUM_HEADS, other=float("-inf")) - max_lse)
        partial = tl.load(partial_out_ptr + ((token * NUM_HEADS + heads) * num_splits + split)[:, None] * HEAD_DIM
                          + dims[None, :], mask=(heads < NUM_HEADS)[:, None], other=0.0)
        acc += weight[:, None] * partial
    output = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + token * stride_o_token + heads[:, None] * stride_o_head + dims[None, :],
             cast_round_nearest(output, out_ptr.dtype.element_ty), mask=(heads < NUM_HEADS)[:, None])


_COMPUTE_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def key_tile_and_launch(block_n: int, block_m: int, model_dtype: torch.dtype, key_code: int, value_code: int,
                        head_dim: int = 128) -> tuple[int, int, int]:
    """Keys per tile, software-pipelining stages and warps of the key loop on CUDA, so that a block fits
    in the 99 KiB of shared memory of the consumer GPUs (sm_86 / 89 / 120) and its registers without
    spilling on sm_90 (`block_m`: rows per query tile).

    Each stage buffers a K and a V tile. At D = 128 Triton's default 3 stages suit 16-bit stores of a
    16-bit model (58 KiB at 64-row tiles); a 4-bit store (its tiles are gathered levels, a key mean adds a
    [BLOCK_N, D] fp32 trig tile) needs 256 KiB at 3 stages, beyond even an H200's 227 KiB, so it takes 1.
    A wider head keeps the bytes of a tile: D = 256 takes half the keys of D = 128, D = 512 a quarter (16,
    the smallest tl.dot side), and 16-bit stores 2 stages from D = 256. Registers (ptxas for sm_90): a
    4-bit store of a 16-bit model takes 8 warps and at most 32 keys, 16 when its keys are 4-bit in a
    64-row tile or a decode tile of D >= 256; an fp32 model (fp32 products without TF32) 8 warps, 16 keys.
    tests/kernels/cuda_compile.py compiles each case and reports shared memory, registers and spills.
    """
    block_n = max(16, min(block_n, block_n * 128 // max(head_dim, 128)))
    if model_dtype == torch.float32:
        return 16, 1, 8
    if Q4 not in (key_code, value_code):
        return block_n, (3 if head_dim <= 128 else 2), (8 if head_dim >= 256 else 4)
    block_n = min(block_n, 32)
    if key_code == Q4 and (block_m >= 64 or head_dim >= 256 and block_m <= 16):
        block_n = 16
    return block_n, 1, 8


def prefill_rows_cap(model_dtype: torch.dtype, key_code: int, value_code: int, head_dim: int) -> int | None:
    """The most query rows a prefill tile may have for these operands to compile without spilling on sm_90
    (None: the plan's default): an fp32 model with a 4-bit store takes 32 rows up to D = 128 and 16 from
    D = 256 (its 16-key tiles still spill at 64 rows: ptxas caps the 8 warps at 255 registers)."""
    if model_dtype != torch.float32 or Q4 not in (key_code, value_code):
        return None
    return 32 if head_dim <= 128 else 16


def paged_attention(query: torch.Tensor, key_store: KVStore, value_store: KVStore, key_format: KernelFormat,
                    value_format: KernelFormat, plan: AttentionPlan, sm_scale: float,
                    key_mean_coeff: torch.Tensor | None = None, trig_table: torch.Tensor | None = None,
                    output: torch.Tensor | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None, softcap: float | None = None,
                    tile_counts: torch.Tensor | None = None, key_limits: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of query [T, H, D] (in the key store's domain) over the paged K/V stores, as `plan` says.

    Returns output [T, H, D] in the value store's domain; rows of padding tokens are left unwritten.
    A 4-bit key mean needs `key_mean_coeff` [T, H, D] fp32 (M @ query per head) and `trig_table` [P, D]
    fp32 (cos | sin halves at positions 0..P-1, P >= the longest context).
    `window`: each query sees its last `window` keys; `sinks` [H]: a logit per query head in the softmax
    denominator only; `softcap`: logits cap * tanh(s / cap). `tile_counts` [tiles, Hkv, splits] int32:
    filled with the key tiles each program visited (a test of what a window costs). `key_limits` [T] int32:
    the last key position each query token sees (at least its own, within its context: a bidirectional image
    span's tokens see the span's last); None: its own, and the kernel compiled without the loads.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_store.data.shape[2]
    key_store.check(key_format.code, num_kv_heads, head_dim)
    value_store.check(value_format.code, num_kv_heads, head_dim)
    if query.stride(-1) != 1 or num_heads % num_kv_heads:
        raise ValueError("paged_attention needs a query with unit last stride and H a multiple of Hkv")
    if query.dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"paged_attention computes in fp16, bf16 or fp32, not {query.dtype}")
    key_mean = key_format.key_mean is not None
    if key_mean and (key_mean_coeff is None or trig_table is None or trig_table.shape[0] < plan.max_seq_len):
        raise ValueError("a 4-bit key mean needs key_mean_coeff and a trig_table covering the longest context")
    if window is not None and not 0 < window < WINDOW_NONE:
        raise ValueError(f"paged_attention takes a window of 1 to {WINDOW_NONE - 1} keys, not {window}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must be one logit per query head [{num_heads}], not {tuple(sinks.shape)}")
    if key_limits is not None and (key_limits.dtype != torch.int32 or tuple(key_limits.shape) != (num_tokens,)):
        raise ValueError(f"key_limits must be int32 [{num_tokens}], not {key_limits.dtype} {tuple(key_limits.shape)}")
    output = torch.empty_like(query) if output is None else output
    unused = plan.tile_seq  # the pointer of an argument the formats do not read
    num_splits = plan.num_splits
    partial_out = partial_lse = unused
    if num_splits > 1:
        partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    sinks_log2 = None if sinks is None else (sinks.float() * LOG2E).contiguous()
    if tile_counts is not None and tuple(tile_counts.shape) != (plan.tile_seq.shape[0], num_kv_heads, num_splits):
        raise ValueError("tile_counts must be int32 [tiles, Hkv, splits]")
    # Triton's interpreter runs tl.dot through numpy, which has no bf16: compute in fp32 there.
    compute = tl.float32 if query.device.type != "cuda" else _COMPUTE_DTYPES[query.dtype]
    grid = (plan.tile_seq.shape[0], num_kv_heads, num_splits)
    group = num_heads // num_kv_heads
    block_n, stages, warps = key_tile_and_launch(plan.block_n, plan.block_m, query.dtype, key_format.code,
                                                 value_format.code, head_dim)
    _paged_attention_kernel[grid](
        query, output, partial_out, partial_lse,
        key_store.data, key_store.scales if key_store.scales is not None else unused,
        key_format.levels if key_format.levels is not None else unused,
        value_store.data, value_store.scales if value_store.scales is not None else unused,
        value_format.levels if value_format.levels is not None else unused,
        key_mean_coeff if key_mean else unused, trig_table if key_mean else unused,
        value_format.value_mean if value_format.value_mean is not None else unused,
        sinks_log2 if sinks_log2 is not None else unused, tile_counts if tile_counts is not None else unused,
        plan.block_tables, plan.query_start, plan.seq_lens, plan.tile_seq, plan.tile_start,
        key_limits if key_limits is not None else unused, sm_scale * LOG2E, WINDOW_NONE if window is None else window,
        2 * LOG2E * sm_scale / softcap if softcap else 0.0, softcap * LOG2E if softcap else 0.0,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        plan.block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_store.data.shape[1],
        GROUP=group, QUERIES_PER_TILE=plan.block_m // group, BLOCK_M=plan.block_m, BLOCK_N=block_n,
        SPLIT_KV=num_splits > 1,
        K_FORMAT=key_format.code, V_FORMAT=value_format.code, KEY_MEAN=key_mean,
        VALUE_MEAN=value_format.value_mean is not None, COMPUTE=compute,
        DOT_PRECISION="ieee" if compute == tl.float32 else "tf32",
        SINKS=sinks is not None, SOFTCAP=bool(softcap), MEAN_SLICE=min(head_dim, MEAN_SLICE),
        COUNT_TILES=tile_counts is not None, KEY_LIMITS=key_limits is not None,
        num_stages=stages, num_warps=warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens,)](
            partial_out, partial_lse, output, plan.query_start[-1:],
            sinks_log2 if sinks_log2 is not None else unused, num_splits, output.stride(0),
            output.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_S=triton.next_power_of_2(num_splits),
            SINKS=sinks is not None,
        )
    return output
