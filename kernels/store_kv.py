"""store_kv: write a batch's new K or V head vectors into the paged pool, quantizing on the way in.

Each program takes BLOCK_T tokens of one KV head. It encodes them exactly as localserve's torch codecs
do (kv/codecs.py): the optional transform into the stored domain, for 4-bit the mean subtracted where
it lowers the vector's norm, the scale search among 17 candidates refitted by least squares, the mean
choice in the scale's sign; for q8_0 absmax / 127 per 32 values and round-half-to-even codes. Results
agree with the torch codecs up to float rounding, so a code may differ at a rounding tie.
A negative slot skips its token (padding rows of a captured decode batch).
The rotation (and a 4-bit key mean's [D, D] fold) is fused into the kernel up to FUSED_ROTATION_MAX
values a head: a [D, D] fp32 matrix in registers is 64 KiB at D = 128 but 1 MiB at 512, so a wider
head (Gemma 4's 256 and 512) is rotated, and its key mean rotated into place, by one batched product in
torch first, and the kernel quantizes what it is given (MEAN_TOKEN: a mean per token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from localserve.kernels.kv_format import PLAIN, Q8_0, Q8_GROUP, KernelFormat, KVStore
from localserve.kernels.rounding import cast_round_nearest, round_half_even

MEAN_NONE, MEAN_ROPE, MEAN_CONSTANT, MEAN_TOKEN = 0, 1, 2, 3
FUSED_ROTATION_MAX = 128
# The format ids as kernel code reads them: compiled (not interpreted) kernels may read only
# tl.constexpr globals.
PLAIN_CODE, Q8_0_CODE = tl.constexpr(PLAIN), tl.constexpr(Q8_0)
TOKENS_PER_PROGRAM = 16  # the rotation product is a tl.dot, whose sides must be at least 16


@triton.jit
def bucketize16(v, midpoints_ptr):
    """torch.bucketize(v, midpoints) for 15 ascending midpoints (padded to 16): the number below v."""
    code = tl.zeros(v.shape, tl.int32)
    for step in tl.static_range(4):  # widths 8, 4, 2, 1
        midpoint = tl.load(midpoints_ptr + code + ((8 >> step) - 1))
        code = tl.where(v > midpoint, code + (8 >> step), code)
    return code


@triton.jit
def _store_kv_kernel(
    x_ptr,  # [T, Hkv, D] new K or V vectors, model dtype
    slot_ptr,  # [T] int64 flat slot (block * block_size + offset); negative: skip the token
    data_ptr,  # [num_slots, Hkv, D] values or int8 codes; Q4: uint8 [num_slots, Hkv, D / 2]
    scales_ptr,  # Q8_0: fp16 [num_slots, Hkv, D / 32]; Q4: fp16 [num_slots, Hkv]; PLAIN: unused
    encode_ptr,  # [Hkv, D, D] fp32, stored = E[g] @ x (ROTATE)
    levels_ptr,  # [16] fp32 ascending levels (Q4)
    midpoints_ptr,  # [16] fp32: 15 midpoints between levels, then +inf (Q4)
    factors_ptr,  # [16] fp32 candidate scale factors of the RMS (Q4 with SEARCH)
    mean_ptr,  # MEAN_ROPE: [Hkv, D, D] fp32 folded key mean; MEAN_CONSTANT: [Hkv, D]; MEAN_TOKEN: [T, Hkv, D]
    trig_ptr,  # [T, D] fp32: cos | sin halves at each token's position (MEAN_ROPE)
    num_tokens,  # T
    max_abs_level,  # float: largest |level| (Q4)
    stride_x_token, stride_x_head,  # x strides in elements (the last one is 1)
    stride_encode_head, stride_mean_head,  # 0 when one matrix / vector serves every KV head
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, FORMAT: tl.constexpr, ROTATE: tl.constexpr,
    MEAN: tl.constexpr, SEARCH: tl.constexpr, BLOCK_T: tl.constexpr,
):
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1)
    valid = slots >= 0
    row = slots * NUM_KV_HEADS + head  # int64: (slot, head) vectors in the store
    x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x_token + head * stride_x_head + dims[None, :],
                mask=valid[:, None], other=0.0)
    if FORMAT == PLAIN_CODE:
        tl.store(data_ptr + row[:, None] * HEAD_DIM + dims[None, :], cast_round_nearest(x, data_ptr.dtype.element_ty),
                 mask=valid[:, None])
    else:
        y = x.to(tl.float32)
        if ROTATE:  # y = x @ E^T; "ieee": no TF32, the product must match the torch codec's fp32 one
            encode_t = tl.load(encode_ptr + head * stride_encode_head + dims[None, :] * HEAD_DIM + dims[:, None])
            y = tl.dot(y, encode_t, input_precision="ieee")
        if FORMAT == Q8_0_CODE:
            _quantize_q8(y, row, valid, data_ptr, scales_ptr, HEAD_DIM)
        else:
            use_mean = tl.zeros([BLOCK_T], tl.int1)
            if MEAN != 0:
                if MEAN == 1:  # keys: the mean before RoPE, rotated to each token's position
                    trig = tl.load(trig_ptr + tokens.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :],
                                   mask=valid[:, None], other=0.0)
                    folded = tl.load(mean_ptr + head * stride_mean_head + dims[:, None] * HEAD_DIM + dims[None, :])
                    mean = tl.dot(trig, folded, input_precision="ieee")
                elif MEAN == 3:  # each token's own, already in the stored domain
                    mean = tl.load(mean_ptr + (tokens.to(tl.int64)[:, None] * NUM_KV_HEADS + head) * HEAD_DIM
                                   + dims[None, :], mask=valid[:, None], other=0.0)
                else:
                    mean = tl.load(mean_ptr + head * stride_mean_head + dims)[None, :]
                centered = y - mean
                use_mean = tl.sum(centered * centered, 1) < tl.sum(y * y, 1)  # only where it lowers the norm
                y = tl.where(use_mean[:, None], centered, y)
            _quantize_q4(y, use_mean, row, valid, data_ptr, scales_ptr, levels_ptr, midpoints_ptr, factors_ptr,
                         max_abs_level, HEAD_DIM, SEARCH, BLOCK_T)


@triton.jit
def _quantize_q8(y, row, valid, data_ptr, scales_ptr, HEAD_DIM: tl.constexpr):
    groups = tl.reshape(y, (y.shape[0], HEAD_DIM // 32, 32))
    scale = tl.div_rn(tl.max(tl.abs(groups), 2), 127.0).to(tl.float16)
    scale32 = scale.to(tl.float32)
    nonzero = scale32 > 0
    inverse = tl.where(nonzero, tl.div_rn(tl.full(scale32.shape, 1.0, tl.float32), tl.where(nonzero, scale32, 1.0)),
                       0.0)
    codes = round_half_even(groups * inverse[:, :, None])
    codes = tl.minimum(tl.maximum(codes, -127.0), 127.0).to(tl.int8)
    dims = tl.arange(0, HEAD_DIM)
    tl.store(data_ptr + row[:, None] * HEAD_DIM + dims[None, :], tl.reshape(codes, y.shape), mask=valid[:, None])
    group_ids = tl.arange(0, HEAD_DIM // 32)
    tl.store(scales_ptr + row[:, None] * (HEAD_DIM // 32) + group_ids[None, :], scale, mask=valid[:, None])


@triton.jit
def _fit_scale(y, y_norm2, candidate, levels_ptr, midpoints_ptr):
    """Codes of y at scale `candidate` [T], their least-squares scale and residual (as quantize_codebook)."""
    codes = bucketize16(tl.div_rn(y, tl.maximum(candidate, 1e-30)[:, None]), midpoints_ptr)
    values = tl.load(levels_ptr + codes)
    dot = tl.sum(values * y, 1)
    norm2 = tl.maximum(tl.sum(values * values, 1), 1e-30)
    return codes, tl.div_rn(dot, norm2), y_norm2 - tl.div_rn(dot * dot, norm2)


@triton.jit
def _quantize_q4(y, use_mean, row, valid, data_ptr, scales_ptr, levels_ptr, midpoints_ptr, factors_ptr,
                 max_abs_level, HEAD_DIM: tl.constexpr, SEARCH: tl.constexpr, BLOCK_T: tl.constexpr):
    absmax_scale = tl.div_rn(tl.max(tl.abs(y), 1), max_abs_level)
    if SEARCH:
        y_norm2 = tl.sum(y * y, 1)
        rms = tl.sqrt_rn(tl.div_rn(y_norm2, HEAD_DIM * 1.0))
        best_residual = tl.full([BLOCK_T], float("inf"), tl.float32)
        best_scale = tl.zeros([BLOCK_T], tl.float32)
        best_codes = tl.zeros([BLOCK_T, HEAD_DIM], tl.int32)
        # Candidates in torch's order (16 around the RMS, then absmax); a strict `<` keeps argmin's first.
        for index in tl.static_range(17):
            if index < 16:
                candidate = rms * tl.load(factors_ptr + index)
            else:
                candidate = absmax_scale
            codes, scale, residual = _fit_scale(y, y_norm2, candidate, levels_ptr, midpoints_ptr)
            better = residual < best_residual
            best_residual = tl.where(better, residual, best_residual)
            best_scale = tl.where(better, scale, best_scale)
            best_codes = tl.where(better[:, None], codes, best_codes)
        scale = tl.maximum(best_scale, 0.0)
    else:
        scale = absmax_scale
        best_codes = bucketize16(tl.div_rn(y, tl.maximum(scale, 1e-30)[:, None]), midpoints_ptr)
    low, high = tl.split(tl.reshape(best_codes, (BLOCK_T, HEAD_DIM // 2, 2)))
    packed = (low | (high << 4)).to(tl.uint8)
    half_dims = tl.arange(0, HEAD_DIM // 2)
    tl.store(data_ptr + row[:, None] * (HEAD_DIM // 2) + half_dims[None, :], packed, mask=valid[:, None])
    scale16 = scale.to(tl.float16)
    tl.store(scales_ptr + row, tl.where(use_mean, -scale16, scale16), mask=valid)


def store_kv(x: torch.Tensor, slot_mapping: torch.Tensor, store: KVStore, fmt: KernelFormat,
             trig: torch.Tensor | None = None) -> None:
    """Write x [T, Hkv, D] at flat slots `slot_mapping` [T] (negative: skip) into `store`, in format `fmt`.

    `trig` [T, D] fp32 (cos | sin halves at each token's position) is needed by a 4-bit key mean.
    """
    num_tokens, num_kv_heads, head_dim = x.shape
    store.check(fmt.code, num_kv_heads, head_dim)
    if x.stride(-1) != 1 or slot_mapping.shape != (num_tokens,):
        raise ValueError("store_kv needs x with unit stride in its last dimension and one slot per token")
    if fmt.code == Q8_0 and head_dim % Q8_GROUP:
        raise ValueError(f"q8_0 needs a head_dim divisible by {Q8_GROUP}, got {head_dim}")
    if num_tokens == 0:
        return
    mean_kind = MEAN_ROPE if fmt.key_mean is not None else MEAN_CONSTANT if fmt.value_mean is not None else 0
    if mean_kind == MEAN_ROPE and (trig is None or trig.shape != (num_tokens, head_dim)):
        raise ValueError("a 4-bit key mean needs trig [T, D]: the cos | sin halves at each token's position")
    mean = fmt.key_mean if mean_kind == MEAN_ROPE else fmt.value_mean
    unused = slot_mapping  # any tensor: the pointer of an argument the format does not read
    encode = fmt.encode_matrix
    if encode is not None and head_dim > FUSED_ROTATION_MAX:  # rotated here, quantized in the kernel
        x = torch.einsum("ged,tgd->tge", encode, x.float()).contiguous()
        encode = None
        if mean_kind == MEAN_ROPE:
            mean, mean_kind = torch.einsum("td,gde->tge", trig.float(), mean).contiguous(), MEAN_TOKEN
    grid = (triton.cdiv(num_tokens, TOKENS_PER_PROGRAM), num_kv_heads)
    _store_kv_kernel[grid](
        x, slot_mapping.to(torch.int64), store.data, store.scales if store.scales is not None else unused,
        encode if encode is not None else unused,
        fmt.levels if fmt.levels is not None else unused, fmt.midpoints if fmt.midpoints is not None else unused,
        fmt.search_factors if fmt.search_factors is not None else unused,
        mean if mean is not None else unused, trig.contiguous() if trig is not None else unused,
        num_tokens, fmt.max_abs_level, x.stride(0), x.stride(1),
        encode.stride(0) if encode is not None else 0, mean.stride(0) if mean is not None else 0,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, FORMAT=fmt.code, ROTATE=encode is not None,
        MEAN=mean_kind, SEARCH=fmt.search_factors is not None, BLOCK_T=TOKENS_PER_PROGRAM,
    )
