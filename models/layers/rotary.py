"""Rotary position embeddings with the scaling variants the supported configs use: default, linear, llama3,
yarn, longrope (Phi-3), proportional (Gemma 4), and GGUF frequency factors; over a whole head or its first
`rotary_dim` values; multimodal (mRoPE) positions for Qwen3.5's images."""

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
    elif rope.rope_type == "longrope":
        inv_freq, scale = inv_freq / _factors(rope.short_factor, head_dim, "short_factor"), _longrope_scale(rope)
    elif rope.rope_type == "proportional":  # the head's first frequencies turn, the others stay still
        turning = int(rope.partial_rotary_factor * head_dim // 2)
        inv_freq = torch.cat((inv_freq[:turning], torch.zeros(head_dim // 2 - turning))) / rope.factor
    return inv_freq, scale


def _factors(values: tuple[float, ...] | None, head_dim: int, name: str) -> torch.Tensor:
    if values is None or len(values) != head_dim // 2:
        raise ValueError(f"longrope needs {head_dim // 2} values in {name}, one per frequency; got "
                         f"{None if values is None else len(values)}")
    return torch.tensor(values, dtype=torch.float32)


def _longrope_scale(rope: RopeConfig) -> float:
    # What transformers' longrope does: attention_factor, else sqrt(1 + ln(factor) / ln(original context)).
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


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

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
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
    """Computes cos/sin for arbitrary positions (no precomputed table, so no length limit).

    `head_dim` is the width it rotates (a model's `rotary_dim` when only part of each head turns). With
    longrope, positions from the original context on use the long factors (each token by its own position,
    so a sequence's earlier keys keep theirs when it grows past that length).
    """

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.long_from = None
        if rope.rope_type == "longrope" and rope.freq_factors is None:
            base_inv_freq = rope_inv_freq(RopeConfig(theta=rope.theta), head_dim)[0]
            long_inv_freq = base_inv_freq / _factors(rope.long_factor, head_dim, "long_factor")
            self.register_buffer("long_inv_freq", long_inv_freq.to(device), persistent=False)
            self.long_from = rope.original_max_position_embeddings

        self.query_scale_beta = rope.query_scale_beta
        self.query_scale_period = rope.original_max_position_embeddings
        axes = None if rope.mrope_section is None else mrope_axes(rope.mrope_section, head_dim // 2, device)
        self.register_buffer("mrope_axes", axes, persistent=False)

    def query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """[T, 1, 1] the factor each token's query is scaled by (Llama 4 / Ministral 3), or None without one."""
        if self.query_scale_beta is None:
            return None
        periods = torch.floor(positions.float() / self.query_scale_period)
        return (1 + self.query_scale_beta * torch.log1p(periods)).to(dtype)[:, None, None]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] in `dtype` (computed in float32 as transformers does).

        With the config's `mrope_section`, positions may be [3, T]: each token's (temporal, height, width)
        positions, each frequency turning with the axis `mrope_axes` gives it (a text token's three are
        equal, which is plain rotary at that position)."""
        if positions.dim() == 2:
            return self._multimodal(positions, dtype)
        inv_freq = self.inv_freq[None, :]
        if self.long_from is not None:
            inv_freq = torch.where(positions[:, None] >= self.long_from, self.long_inv_freq[None, :], inv_freq)
        freqs = positions.float()[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)

    def _multimodal(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mrope_axes is None or positions.shape[0] != 3:
            raise ValueError(f"rotary: positions of shape {list(positions.shape)} need [3, tokens] and a model "
                             f"with multimodal rotary sections (mrope_section); this one has "
                             f"{'them' if self.mrope_axes is not None else 'none'}")
        if self.long_from is not None or self.query_scale_beta is not None:
            raise ValueError("rotary: multimodal positions with longrope or query scaling are not supported")
        freqs = positions.float()[:, :, None] * self.inv_freq[None, None, :]  # [3, T, F]
        index = self.mrope_axes[None, None, :].expand(1, *freqs.shape[1:])
        freqs = freqs.gather(0, index)[0]  # [T, F]: each frequency from its axis
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def mrope_axes(sections: tuple[int, int, int], num_freqs: int, device: torch.device | str | None = None
               ) -> torch.Tensor:
    """The axis (0 temporal, 1 height, 2 width) each of `num_freqs` frequencies turns with in interleaved
    mRoPE (RopeConfig.mrope_section): height where i % 3 == 1 and i < 3 * sections[1], width where i % 3 == 2
    and i < 3 * sections[2], temporal elsewhere, as transformers' Qwen3.5 text rotary recomposes them."""
    axes = torch.zeros(num_freqs, dtype=torch.int64)
    for axis in (1, 2):
        axes[axis:3 * sections[axis]:3] = axis
    return axes.to(device)
