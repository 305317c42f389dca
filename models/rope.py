"""Rotary position embeddings with the scaling variants the supported configs use."""

from __future__ import annotations

import math

import torch
from localserve.models.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the factor that scales cos and sin."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    scale = 1.0
    if rope.freq_factors is not None:  # GGUF files carry llama3-style scaling as per-frequency divisors
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    elif rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq, scale = _yarn_inv_freq(rope, head_dim)
    return inv_freq, scale


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated smoothly.
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    scale = rope.attention_factor
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(scale)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for arbitrary positions (no precomputed table, so no length limit)."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] in `dtype` (computed in float32 as transformers does)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)
