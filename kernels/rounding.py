"""Rounding helpers shared by the kernels, bit-exact with torch on the GPU and in Triton's interpreter."""

import triton
import triton.language as tl


@triton.jit
def round_half_even(v):
    """torch.round's rounding (half to even), for |v| < 2**22."""
    rounded = tl.floor(v + 0.5)
    tie = (rounded - v) == 0.5
    odd = (rounded - 2.0 * tl.floor(rounded * 0.5)) != 0.0
    return tl.where(tie & odd, rounded - 1.0, rounded)


@triton.jit
def cast_round_nearest(x, dtype: tl.constexpr):
    """x.to(dtype) with round-to-nearest-even, as torch casts.

    Triton's interpreter truncates when it narrows to bf16, so bf16 is rounded here on the bits:
    adding 0x7FFF plus the lowest kept bit carries exactly the halves that round up (NaN stays NaN).
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
