"""llama.cpp's GGUF block formats of quantized weights, as localserve keeps them on the device.

A quantized weight [N, K] is held as the file stores it: row n is K / block_values blocks of block_bytes
bytes each (`uint8 [N, row_bytes]`). The byte layout of each format is spelled out where its values are
decoded (gguf_dequant.py). Standard library only: the loader and `localserve plan` read this table on
machines without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF block format: its layout, and how the kernels cut a tile of blocks into planes."""

    name: str  # GGML's name, e.g. "Q4_K"
    code: int  # the kernels' compile-time id
    block_values: int  # weights per block
    block_bytes: int  # bytes per block
    planes: int  # planes per tile (gguf_dequant.py)
    group: int  # consecutive positions of a plane that share one scale and offset (gguf_dequant.py)
    half_offsets: tuple[int, ...]  # byte offsets of the block's fp16 fields (d, then dmin or m), little-endian
    exponent_offsets: tuple[int, ...] = ()  # byte offsets of its E8M0 scales (a power of two: 2^(byte - 127))

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of `in_features` weights (a multiple of block_values)."""
        if in_features % self.block_values:
            raise ValueError(f"a {self.name} row holds a multiple of {self.block_values} values, not {in_features}")
        return in_features // self.block_values * self.block_bytes


QUANT_FORMATS = {fmt.name: fmt for fmt in (
    QuantFormat("Q4_0", 0, 32, 18, 2, 16, (0,)),
    QuantFormat("Q4_1", 1, 32, 20, 2, 16, (0, 2)),
    QuantFormat("Q5_0", 2, 32, 22, 2, 16, (0,)),
    QuantFormat("Q5_1", 3, 32, 24, 2, 16, (0, 2)),
    QuantFormat("Q8_0", 4, 32, 34, 1, 32, (0,)),
    QuantFormat("Q2_K", 5, 256, 84, 4, 16, (80, 82)),
    QuantFormat("Q3_K", 6, 256, 110, 4, 16, (108,)),
    QuantFormat("Q4_K", 7, 256, 144, 2, 32, (0, 2)),
    QuantFormat("Q5_K", 8, 256, 176, 2, 32, (0, 2)),
    QuantFormat("Q6_K", 9, 256, 210, 2, 16, (208,)),
    QuantFormat("MXFP4", 10, 32, 17, 2, 16, (), exponent_offsets=(0,)),
)}

# Not a GGUF format: dense rows (bf16, fp16 or fp32 elements) described as one-value blocks, so that the
# kernels' tile loops read dense weights too (the fused-MoE kernels' dense experts). A "byte" here is one
# element: the kernels index a typed pointer.
DENSE_ROWS = QuantFormat("dense", 11, 1, 1, 1, 1, ())
