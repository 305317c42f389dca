"""MXFP4 weights as Hugging Face checkpoints store them (transformers' `quant_method: mxfp4`, gpt-oss's
experts): a pair of uint8 tensors `<name>_blocks` [..., rows, groups, 16] and `<name>_scales`
[..., rows, groups], rows being the outputs and each group 32 consecutive inputs.

A group's 16 bytes hold its 32 E2M1 codes two a byte, value 2i in the low nibble of byte i and value 2i+1
in the high one; its scale byte is an E8M0 exponent e, the group's values being code * 2^(e - 127). GGUF's
MXFP4 block (17 bytes: the same exponent byte, then value j in the low nibble of byte j and value j + 16
in the high one; kernels/gguf_blocks.py) holds the same numbers, so a pair is repacked into GGUF blocks
once at load: kept so on the device for the kernels, or dequantized here where they cannot run.
"""

from __future__ import annotations

import torch

from localserve.models.layers.linear import QuantizedTensor

BLOCKS, SCALES = "_blocks", "_scales"
# E2M1 codes 0..15: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class MXFP4Error(ValueError):
    """A blocks/scales pair that does not hold MXFP4 weights."""


def partner(name: str) -> str | None:
    """The scales of a `_blocks` tensor; None for a name that is no blocks."""
    return name.removesuffix(BLOCKS) + SCALES if name.endswith(BLOCKS) else None


def _check(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MXFP4Error(f"{name}: MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise MXFP4Error(f"{name}: MXFP4 blocks of shape {tuple(blocks.shape)} do not match scales of shape "
                         f"{tuple(scales.shape)} (blocks [..., groups, 16], scales [..., groups])")


def to_gguf_blocks(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    """The pair as GGUF MXFP4 blocks uint8 [..., rows, groups * 17], of a weight [..., rows, groups * 32]."""
    _check(name, blocks, scales)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., groups, 32] in value order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    gguf_blocks = torch.cat((scales.unsqueeze(-1), packed), dim=-1).flatten(-2)
    shape = (*scales.shape[:-1], scales.shape[-1] * 32)
    return QuantizedTensor(gguf_blocks.contiguous(), "MXFP4", shape)


def dequantize(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The pair's weight [..., rows, groups * 32] in float32."""
    _check(name, blocks, scales)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1).float()).flatten(-2)
