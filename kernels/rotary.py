"""The rotate-half rotary embedding's arithmetic (torch only): how the model rotates queries and keys, how
the 4-bit KV format rotates its key mean to a key's position, and the cos / sin halves the kernels fold
that mean with (kv_format.fold_key_mean). The frequencies are the model's (models/layers/rotary.py)."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated in the Hugging Face (rotate-half) layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary_halves(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotate-half RoPE's cos, sin [T, D] (each half holds every frequency once) -> [cos_half, sin_half]
    [T, D] fp32: the row that multiplies `fold_key_mean`'s M to give a key's stored-domain mean."""
    half = cos.shape[-1] // 2
    return torch.cat((cos[:, :half], sin[:, :half]), dim=-1).float().contiguous()
