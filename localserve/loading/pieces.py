"""A checkpoint tensor cut to the part a `Target` names (rows of a fused tensor, Q/K rows put back in the
rotate-half order, head groups put back in the model's order, stored values mapped back), dense or as
quantized blocks (whole rows, so blocks are cut and moved as they are)."""

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
        if target.transpose or target.axis == tensor.blocks.dim() - 1 or target.values is not None:
            raise ValueError(f"{target.name}: quantized blocks are cut and reordered by whole rows, never "
                             "transposed or mapped")
        blocks = _take_rows(tensor.blocks, target)
        shape = (*blocks.shape[:-1], tensor.shape[-1])
        return QuantizedTensor(blocks, tensor.qtype, shape)
    return _take_rows(tensor, target)


def regroup(tensor: torch.Tensor, axis: int, start: int, outer: int, inner: int, size: int) -> torch.Tensor:
    """`tensor` with the outer * inner * size entries from `start` along `axis`, read as [outer, inner, size],
    put in [inner, outer, size] order (the rest as it was)."""
    stop = start + outer * inner * size
    if stop > tensor.shape[axis]:
        raise ValueError(f"regroup of {outer} x {inner} x {size} from {start} runs past {tensor.shape[axis]} "
                         f"entries along axis {axis}")
    part = tensor.narrow(axis, start, stop - start)
    shape = list(part.shape)
    grouped = part.reshape(*shape[:axis], outer, inner, size, *shape[axis + 1:]).transpose(axis, axis + 1)
    after = tensor.narrow(axis, stop, tensor.shape[axis] - stop)
    return torch.cat([tensor.narrow(axis, 0, start), grouped.reshape(shape), after], dim=axis)


def _take_rows(tensor: torch.Tensor, target: Target) -> torch.Tensor:
    if target.regroup is not None:
        tensor = regroup(tensor, target.axis, *target.regroup)
    if target.rows is not None:
        start, stop = target.rows
        index = [slice(None)] * tensor.dim()
        index[target.axis] = slice(start, stop, target.step)
        tensor = tensor[tuple(index)]
    if target.transpose:
        tensor = tensor.transpose(-1, -2)
    if target.unpermute_heads is not None:
        tensor = unpermute_rotary(tensor, target.unpermute_heads)
    if target.values is not None:
        tensor = VALUE_MAPS[target.values](tensor)
    return tensor.contiguous()


# models/family.py's VALUE_MAPS: the stored values -> the parameter's.
VALUE_MAPS = {"log_neg": lambda stored: torch.log(-stored)}
