"""Dequantizing llama.cpp's GGUF weight formats (layouts in gguf_blocks.py) in Triton: per format one
function that turns a tile of a weight's raw blocks into float32 values.

A *tile* is TILE_BLOCKS consecutive blocks of BLOCK_N
rows. Its values come out in *planes*: plane p holds the values whose codes sit at one bit position of
the code bytes (Q4_0: the low nibbles, then the high nibbles), so every code byte is read in order, as
stored, and no values move between lanes. Each plane also gives the column of each of its values
within the tile; the kernels read the activations at those columns, so the dot products are the
same sums taken in another order.

Every format is the same thing in the end: value = scale[g] * code + offset[g], with integer codes and
one (scale, offset) per group of GROUP consecutive plane positions (a plane's values are ordered so
that a group is a run), both computed in float32 in the order of `gguf.quants`, the reference the
tests compare with (Q4_K: scale d * sc, offset -(dmin * m)), so a dequantized value equals the
reference's. A matrix-vector product takes the scales out of the inner sum (`plane_dot`): per group
one multiply instead of one per weight.
"""

from __future__ import annotations

import triton
import triton.language as tl
from localserve.kernels import gguf_blocks

# The format ids as kernel code reads them: compiled (not interpreted) kernels may read only
# tl.constexpr globals.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4 = (
    tl.constexpr(gguf_blocks.QUANT_FORMATS[name].code)
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4"))
DENSE = tl.constexpr(gguf_blocks.DENSE_ROWS.code)


@triton.jit
def _halves(rows, offsets):
    """Little-endian fp16 fields at byte `offsets` [G] of `rows` ([BN, 1] pointers), as float32 [BN, G]
    (two byte loads: the fields are only 2-byte aligned in most layouts)."""
    low = tl.load(rows + offsets[None, :]).to(tl.uint16)
    high = tl.load(rows + offsets[None, :] + 1).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _spread(group_values, GROUP: tl.constexpr):
    """[BN, G] per-group values -> [BN, G * GROUP]: each repeated over its group's positions."""
    spread = tl.broadcast_to(group_values[:, :, None], (group_values.shape[0], group_values.shape[1], GROUP))
    return tl.reshape(spread, (group_values.shape[0], group_values.shape[1] * GROUP))


@triton.jit
def _legacy(rows, last_block, BLOCK_BYTES: tl.constexpr, CODES_AT: tl.constexpr, HIGH_BITS_AT: tl.constexpr,
            MIN_AT: tl.constexpr, CODE_OFFSET: tl.constexpr, PLANE: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """Q4_0, Q4_1, Q5_0, Q5_1 (32 values a block): value j of a block is the low nibble of code byte j
    (j < 16) or the high nibble of byte j - 16, plus for 5-bit types bit j of the 32-bit field at
    HIGH_BITS_AT as its fifth bit; then d * (q - CODE_OFFSET), or d * q + m (MIN_AT >= 0). Plane 0
    holds the first 16 values of each block, plane 1 the last 16; a group is a block's 16."""
    position = tl.arange(0, TILE_BLOCKS * 16)
    block, index = position // 16, position % 16
    at = tl.minimum(block, last_block) * BLOCK_BYTES
    q = (tl.load(rows + (at + CODES_AT + index)[None, :]) >> (4 * PLANE)) & 15
    if HIGH_BITS_AT >= 0:
        j = PLANE * 16 + index
        q |= ((tl.load(rows + (at + HIGH_BITS_AT + j // 8)[None, :]) >> (j % 8).to(tl.uint8)) & 1) << 4
    group_at = tl.minimum(tl.arange(0, TILE_BLOCKS), last_block) * BLOCK_BYTES
    scale = _halves(rows, group_at)
    if MIN_AT >= 0:
        offset = _halves(rows, group_at + MIN_AT)
    else:
        offset = tl.zeros(scale.shape, tl.float32)
    codes = q.to(tl.float32)
    if CODE_OFFSET != 0:
        codes -= CODE_OFFSET
    return codes, scale, offset, block * 32 + PLANE * 16 + index


@triton.jit
def _q8_0(rows, last_block, TILE_BLOCKS: tl.constexpr):
    """Q8_0: d (fp16), then 32 int8 codes; value d * q. One plane, in the stored order; a group is a block."""
    position = tl.arange(0, TILE_BLOCKS * 32)
    at = tl.minimum(position // 32, last_block) * 34 + 2 + position % 32
    q = tl.load(rows + at[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
    scale = _halves(rows, tl.minimum(tl.arange(0, TILE_BLOCKS), last_block) * 34)
    return q, scale, tl.zeros(scale.shape, tl.float32), position


@triton.jit
def _dense(rows, last_block, TILE_BLOCKS: tl.constexpr):
    """Dense rows (gguf_blocks.DENSE_ROWS): TILE_BLOCKS values as stored; scale 1 and offset 0, a group each."""
    position = tl.arange(0, TILE_BLOCKS)
    values = tl.load(rows + tl.minimum(position, last_block)[None, :]).to(tl.float32)
    return values, tl.full(values.shape, 1.0, tl.float32), tl.zeros(values.shape, tl.float32), position


@triton.jit
def _mxfp4(rows, last_block, PLANE: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """MXFP4 (17 bytes: an E8M0 exponent e, then 16 code bytes; 32 values a block): value j is the low
    nibble of code byte j (j < 16) or the high nibble of byte j - 16, an FP4 E2M1 code: bit 3 the sign,
    bits 0-2 a magnitude 0, 0.5, 1, 1.5, 2, 3, 4 or 6, kept doubled as gguf keeps them (0, 1, 2, 3, 4, 6,
    8, 12), so the scale is 2^(e - 127) / 2 = 2^(e - 128), built as float32 bits (a subnormal for e < 2).
    Planes and groups as the legacy formats: a plane holds 16 values of each block, a group is a block's."""
    position = tl.arange(0, TILE_BLOCKS * 16)
    block, index = position // 16, position % 16
    at = tl.minimum(block, last_block) * 17
    code = ((tl.load(rows + (at + 1 + index)[None, :]) >> (4 * PLANE)) & 15).to(tl.int32)
    magnitude = code & 7
    # 0..3 are their own doubled values; 4..7 are 4, 6, 8, 12: (2 or 3) times 2 or 4.
    doubled = tl.where(magnitude < 4, magnitude, (2 + (magnitude & 1)) << tl.maximum((magnitude >> 1) - 1, 0))
    codes = tl.where(code >= 8, -doubled, doubled).to(tl.float32)
    exponent = tl.load(rows + (tl.minimum(tl.arange(0, TILE_BLOCKS), last_block) * 17)[None, :]).to(tl.int32)
    bits = tl.where(exponent < 2, 0x00200000 << exponent, (exponent - 1) << 23)
    scale = bits.to(tl.float32, bitcast=True)
    return codes, scale, tl.zeros(scale.shape, tl.float32), block * 32 + PLANE * 16 + index


@triton.jit
def _k_scale_min(rows, block_at, sub):
    """Q4_K / Q5_K: (d * sc, -(dmin * m)) [BN, G] of sub-blocks `sub` [G] (0..7) of the blocks at byte
    `block_at` [G], from fp16 d and dmin and 12 bytes of 6-bit scales and mins (gguf's get_scale_min)."""
    scales_at = block_at + 4
    this = tl.load(rows + (scales_at + sub)[None, :]).to(tl.int32)
    next4 = tl.load(rows + (scales_at + sub + 4)[None, :]).to(tl.int32)
    before4 = tl.load(rows + (scales_at + tl.maximum(sub - 4, 0))[None, :]).to(tl.int32)
    low = (sub < 4)[None, :]
    scale = tl.where(low, this & 63, (next4 & 15) | ((before4 >> 6) << 4))
    minimum = tl.where(low, next4 & 63, (next4 >> 4) | ((this >> 6) << 4))
    return _halves(rows, block_at) * scale.to(tl.float32), -(_halves(rows, block_at + 2) * minimum.to(tl.float32))


@triton.jit
def _q45_k(rows, last_block, BLOCK_BYTES: tl.constexpr, CODES_AT: tl.constexpr, FIVE_BITS: tl.constexpr,
           PLANE: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 code bytes) and Q5_K (176 bytes: d, dmin, 12 scale
    bytes, 32 bytes of fifth bits, 128 code bytes). Code byte c * 32 + i holds value c * 64 + i in its
    low nibble and c * 64 + 32 + i in its high one (sub-blocks 2c and 2c + 1, each with its own scale
    and min: the groups); Q5_K's fifth bit of value j is bit j // 32 of byte j % 32.
    Value (d * sc) * q - dmin * m."""
    position = tl.arange(0, TILE_BLOCKS * 128)
    block, within = position // 128, position % 128
    at = tl.minimum(block, last_block) * BLOCK_BYTES
    q = (tl.load(rows + (at + CODES_AT + within)[None, :]).to(tl.int32) >> (4 * PLANE)) & 15
    if FIVE_BITS:
        bit = 2 * (within // 32) + PLANE
        q |= ((tl.load(rows + (at + 16 + within % 32)[None, :]).to(tl.int32) >> bit) & 1) << 4
    group = tl.arange(0, TILE_BLOCKS * 4)  # (block, 32-value chunk c)
    scale, offset = _k_scale_min(rows, tl.minimum(group // 4, last_block) * BLOCK_BYTES, 2 * (group % 4) + PLANE)
    return q.to(tl.float32), scale, offset, block * 256 + (within // 32) * 64 + PLANE * 32 + within % 32


@triton.jit
def _q6_k(rows, last_block, PLANE: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """Q6_K (210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, fp16 d). In each
    128-value half h, low byte h * 64 + i holds value h * 128 + i (low nibble, plane 0) and
    h * 128 + 64 + i (high nibble, plane 1); high byte h * 32 + i holds bits 4-5 of values
    h * 128 + 32u + i at bits 2u. One scale per 16 values: (d * scale) * (q - 32)."""
    position = tl.arange(0, TILE_BLOCKS * 128)
    block, within = position // 128, position % 128
    half, index = within // 64, within % 64
    at = tl.minimum(block, last_block) * 210
    low = (tl.load(rows + (at + half * 64 + index)[None, :]).to(tl.int32) >> (4 * PLANE)) & 15
    shift = 2 * (2 * PLANE + index // 32)
    high = (tl.load(rows + (at + 128 + half * 32 + index % 32)[None, :]).to(tl.int32) >> shift) & 3
    group = tl.arange(0, TILE_BLOCKS * 8)  # (block, half, 16 values)
    group_at = tl.minimum(group // 8, last_block) * 210
    scale_at = group_at + 192 + ((group % 8) // 4) * 8 + PLANE * 4 + group % 4
    sub_scale = tl.load(rows + scale_at[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
    scale = _halves(rows, group_at + 208) * sub_scale
    codes = ((low | (high << 4)) - 32).to(tl.float32)
    return codes, scale, tl.zeros(scale.shape, tl.float32), block * 256 + half * 128 + PLANE * 64 + index


@triton.jit
def _q23_k(rows, last_block, BLOCK_BYTES: tl.constexpr, CODES_AT: tl.constexpr, THREE_BITS: tl.constexpr,
           PLANE: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """Q2_K (84 bytes: 16 scale/min bytes, 64 code bytes, fp16 d, dmin) and Q3_K (110 bytes: 32 bytes of
    third bits, 64 code bytes, 12 bytes of 6-bit scales, fp16 d). In each 128-value half h, code byte
    h * 32 + i holds value h * 128 + 32t + i at bits 2t (plane t); Q3_K subtracts 4 where bit
    (h * 4 + t) of byte i of its third bits is clear. One scale per 16 values:
    Q2_K (d * (s & 15)) * q - dmin * (s >> 4); Q3_K (d * (sc - 32)) * q."""
    position = tl.arange(0, TILE_BLOCKS * 64)
    block, within = position // 64, position % 64
    half, index = within // 32, within % 32
    at = tl.minimum(block, last_block) * BLOCK_BYTES
    q = (tl.load(rows + (at + CODES_AT + half * 32 + index)[None, :]).to(tl.int32) >> (2 * PLANE)) & 3
    group = tl.arange(0, TILE_BLOCKS * 4)  # (block, half, 16 values)
    group_at = tl.minimum(group // 4, last_block) * BLOCK_BYTES
    sub = ((group % 4) // 2) * 8 + PLANE * 2 + group % 2  # which of the block's 16 scales
    if THREE_BITS:
        third = (tl.load(rows + (at + index)[None, :]).to(tl.int32) >> (half * 4 + PLANE)) & 1
        q = q - 4 + 4 * third
        low4 = (tl.load(rows + (group_at + 96 + sub % 8)[None, :]).to(tl.int32) >> (4 * (sub // 8))) & 15
        high2 = (tl.load(rows + (group_at + 104 + sub % 4)[None, :]).to(tl.int32) >> (2 * (sub // 4))) & 3
        scale = _halves(rows, group_at + 108) * ((low4 | (high2 << 4)) - 32).to(tl.float32)
        offset = tl.zeros(scale.shape, tl.float32)
    else:
        packed = tl.load(rows + (group_at + sub)[None, :]).to(tl.int32)
        scale = _halves(rows, group_at + 80) * (packed & 15).to(tl.float32)
        offset = -(_halves(rows, group_at + 82) * (packed >> 4).to(tl.float32))
    return q.to(tl.float32), scale, offset, block * 256 + half * 128 + PLANE * 32 + index


@triton.jit
def plane_codes(rows, last_block, FORMAT: tl.constexpr, PLANE: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """One plane of a tile: (codes float32 [BN, P], scale and offset float32 [BN, P / GROUP], the
    columns [P] of the plane's values within the tile); value = scale[g] * code + offset[g].

    rows [BN, 1]: pointers (uint8; DENSE: of the weights' dtype) to the tile's first byte in each row of W;
    last_block: the index within the tile of the row's last block. Positions in blocks past it (a tile
    overhanging the row) read that last block again, so every load stays inside W without a mask: their
    columns lie past the row's end, where the caller reads x as zeros and stores nothing. Rows past W's
    end are likewise the caller's to clamp.
    """
    if FORMAT == Q8_0:
        return _q8_0(rows, last_block, TILE_BLOCKS)
    elif FORMAT == Q4_0:
        return _legacy(rows, last_block, 18, 2, -1, -1, 8, PLANE, TILE_BLOCKS)
    elif FORMAT == Q4_1:
        return _legacy(rows, last_block, 20, 4, -1, 2, 0, PLANE, TILE_BLOCKS)
    elif FORMAT == Q5_0:
        return _legacy(rows, last_block, 22, 6, 2, -1, 16, PLANE, TILE_BLOCKS)
    elif FORMAT == Q5_1:
        return _legacy(rows, last_block, 24, 8, 4, 2, 0, PLANE, TILE_BLOCKS)
    elif FORMAT == Q4_K:
        return _q45_k(rows, last_block, 144, 16, False, PLANE, TILE_BLOCKS)
    elif FORMAT == Q5_K:
        return _q45_k(rows, last_block, 176, 48, True, PLANE, TILE_BLOCKS)
    elif FORMAT == Q6_K:
        return _q6_k(rows, last_block, PLANE, TILE_BLOCKS)
    elif FORMAT == Q2_K:
        return _q23_k(rows, last_block, 84, 16, False, PLANE, TILE_BLOCKS)
    elif FORMAT == MXFP4:
        return _mxfp4(rows, last_block, PLANE, TILE_BLOCKS)
    elif FORMAT == DENSE:
        return _dense(rows, last_block, TILE_BLOCKS)
    else:
        return _q23_k(rows, last_block, 110, 32, True, PLANE, TILE_BLOCKS)


@triton.jit
def dequantize_plane(rows, last_block, FORMAT: tl.constexpr, PLANE: tl.constexpr, TILE_BLOCKS: tl.constexpr,
                     GROUP: tl.constexpr):
    """(values float32 [BN, P], columns [P]) of one plane of a tile (arguments as plane_codes; GROUP: the
    format's plane positions per scale)."""
    codes, scale, offset, columns = plane_codes(rows, last_block, FORMAT, PLANE, TILE_BLOCKS)
    return _spread(scale, GROUP) * codes + _spread(offset, GROUP), columns


@triton.jit
def plane_dot(codes, scale, offset, x, GROUP: tl.constexpr):
    """[BN]: the plane's weights times x [P] (x at the plane's columns), as the sum over groups of
    scale * (codes . x) + offset * sum(x)."""
    code_sums = tl.sum(tl.reshape(codes * x[None, :], (codes.shape[0], scale.shape[1], GROUP)), 2)
    x_sums = tl.sum(tl.reshape(x, (scale.shape[1], GROUP)), 1)
    return tl.sum(scale * code_sums + offset * x_sums[None, :], 1)
