"""A checkpoint tensor cut to the part a `Target` names (rows of a fused tensor, Q/K rows put back in the
rotate-half order), dense or as quantized blocks (whole rows, so blocks are cut and moved as they are)."""

from __future__ import annotations

import torch

from localserve.models.family import Target
from localserve.models.layers.linear import QuantizedTensor


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of rotary halves in a Q or K projection (weight or bias)."""
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def same_values(have: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether a tensor of shape `have` holds a parameter of shape `want`: the same, or the same but for
    axes of size 1 (llama.cpp stores the shared expert's gate [1, H] as [H])."""
    return have == want or [d for d in have if d != 1] == [d for d in want if d != 1]


def take(tensor: torch.Tensor | QuantizedTensor, target: Target) -> torch.Tensor | QuantizedTensor:
    """The part of `tensor` that `target` names (a quantized tensor's blocks cut by whole rows, never
    transposed)."""
    if isinstance(tensor, QuantizedTensor):
        if target.transpose or target.axis == tensor.blocks.dim() - 1:
            raise ValueError(f"{target.name}: quantized blocks are cut by whole rows, never transposed")
        blocks = _take_rows(tensor.blocks, target)
        shape = (*blocks.shape[:-1], tensor.shape[-1])
        return QuantizedTensor(blocks, tensor.qtype, shape)
    return _take_rows(tensor, target)


def _take_rows(tensor: torch.Tensor, target: Target) -> torch.Tensor:
    if target.rows is not None:
        start, stop = target.rows
        index = [slice(None)] * tensor.dim()
        index[target.axis] = slice(start, stop, target.step)
        tensor = tensor[tuple(index)]
    if target.transpose:
        tensor = tensor.transpose(-1, -2)
    if target.unpermute_heads is not None:
        tensor = unpermute_rotary(tensor, target.unpermute_heads)
    return tensor.contiguous()
