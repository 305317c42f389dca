"""A K or V store as the kernels see it: the stored tensors of one layer and the parameters of its format.

The kernels know three layouts (the byte layouts of localserve's KV formats), chosen at compile time:
- PLAIN: the values in the store's dtype, [num_blocks, block_size, Hkv, D].
- Q8_0: int8 codes [.., Hkv, D] and one fp16 scale per 32 values [.., Hkv, D / 32].
- Q4: two 4-bit codes per byte [.., Hkv, D / 2] (element 2i in the low nibble) and one fp16 scale per
  head vector [.., Hkv]; the value is levels[code] * |scale|, plus the format's mean where the scale's
  sign bit is set (the scale may be -0.0, so the bit is tested, never `< 0`).
A quantized store may hold each vector in a transformed domain: stored = E @ x per KV head; attention
then takes the query already mapped into that domain and returns its output there (the attention
backend maps both, once per layer, as the torch backend does).
This module depends on torch only; each of localserve's codecs describes its format in these terms
(KVCodec.kernel_format).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PLAIN, Q8_0, Q4 = 0, 1, 2
Q8_GROUP = 32  # values per q8_0 scale


@dataclass(frozen=True)
class KernelFormat:
    """The parameters of one layer's K or V format, as fp32 tensors on the pool's device.

    `key_mean` is the 4-bit key mean before RoPE folded with the encode matrix: a key at a position whose
    rotary cos / sin halves are c, s [D / 2] has the stored-domain mean [c, s] @ key_mean[g] (the sum
    over frequency pairs that makes the mean one small product instead of a D x D one per key).
    """

    code: int  # PLAIN, Q8_0 or Q4
    encode_matrix: torch.Tensor | None = None  # [Hkv, D, D]: stored = E[g] @ x; None: stored as is
    levels: torch.Tensor | None = None  # [16] ascending 4-bit levels (Q4)
    midpoints: torch.Tensor | None = None  # [16]: the 15 decision points between levels, then +inf (Q4)
    search_factors: torch.Tensor | None = None  # [16] candidate scales rms * factor beside absmax; None: absmax
    key_mean: torch.Tensor | None = None  # [Hkv, D, D] (Q4 keys, see above)
    value_mean: torch.Tensor | None = None  # [Hkv, D] stored-domain mean (Q4 values)
    # The largest |level| (Q4): the absmax scale maps a vector's largest entry onto it. A host number,
    # read once here, so that writing never waits for the device (nor breaks a graph capture).
    max_abs_level: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.code == Q4 and (self.levels is None or self.midpoints is None):
            raise ValueError("a 4-bit format needs its levels and midpoints")
        if self.key_mean is not None and self.value_mean is not None:
            raise ValueError("a store holds keys or values, so it has a key mean or a value mean, not both")
        if self.levels is not None:
            object.__setattr__(self, "max_abs_level", float(self.levels.abs().max()))


def q4_midpoints(levels: torch.Tensor) -> torch.Tensor:
    """The decision points of ascending `levels` [16] padded with +inf to 16 entries (a power of two)."""
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.cat((midpoints, midpoints.new_full((1,), float("inf"))))


def fold_key_mean(encode_matrix: torch.Tensor, key_mean: torch.Tensor) -> torch.Tensor:
    """M [Hkv, D, D] with E[g] @ rope(mu[g], p) == [cos_half(p), sin_half(p)] @ M[g] for every position p.

    With h = D / 2 and the rotate-half RoPE: rope(mu)_d = mu_d cos_i + rot(mu)_d sin_i, i = d mod h,
    rot(mu) = [-mu[h:], mu[:h]]; gathering the terms of each frequency i gives the two halves of M.
    """
    half = key_mean.shape[-1] // 2
    low, high = encode_matrix[..., :half], encode_matrix[..., half:]  # [Hkv, D, h]: columns of E
    mu_low, mu_high = key_mean[:, None, :half], key_mean[:, None, half:]  # [Hkv, 1, h]
    cos_part = low * mu_low + high * mu_high  # [Hkv, D(e), h(i)]
    sin_part = high * mu_low - low * mu_high
    return torch.cat((cos_part, sin_part), dim=-1).transpose(-1, -2).contiguous()


@dataclass
class KVStore:
    """One layer's K or V tensors in the paged pool (see the module docstring for the layouts)."""

    data: torch.Tensor  # PLAIN: [num_blocks, block_size, Hkv, D]; Q8_0: int8 same; Q4: uint8 [.., Hkv, D / 2]
    scales: torch.Tensor | None = None  # Q8_0: fp16 [.., Hkv, D / 32]; Q4: fp16 [.., Hkv]; PLAIN: None

    def check(self, code: int, num_kv_heads: int, head_dim: int) -> None:
        """Raise ValueError unless the tensors have the layout the kernels index (contiguous, right shapes)."""
        if head_dim < 16 or head_dim & (head_dim - 1):  # tl.arange needs a power of two, tl.dot sides >= 16
            raise ValueError(f"the Triton kernels need a head_dim that is a power of two >= 16, got {head_dim}")
        per_head = {PLAIN: head_dim, Q8_0: head_dim, Q4: head_dim // 2}[code]
        if self.data.dim() != 4 or tuple(self.data.shape[2:]) != (num_kv_heads, per_head):
            raise ValueError(f"KV store data has shape {tuple(self.data.shape)}, expected [blocks, block_size, "
                             f"{num_kv_heads}, {per_head}]")
        if not self.data.is_contiguous():
            raise ValueError("KV store data must be contiguous (the kernels compute flat slot offsets)")
        if code == PLAIN:
            return
        scales_shape = (num_kv_heads, head_dim // Q8_GROUP) if code == Q8_0 else (num_kv_heads,)
        if (self.scales is None or tuple(self.scales.shape[2:]) != scales_shape
                or self.scales.dtype != torch.float16 or not self.scales.is_contiguous()):
            raise ValueError(f"KV store scales must be contiguous fp16 [blocks, block_size, {scales_shape}]")
