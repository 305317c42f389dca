"""The 4-bit KV format's calibration: per layer and KV head, the key and value means and a key transform,
and the math that derives them from one layer's recorded queries, keys and values.

- key_mean: the mean key before RoPE (the codec rotates it to each key's position);
- value_mean: the mean value;
- key_transform A: minimises the expected score error q^T A^-1 e for quantization noise e that is
  isotropic after the rotation with a power proportional to |A r|^2 (r: the key less its mean). With
  Ck, Cq the second moments of r and of the group's queries, the optimum has A^T A = M where
  M Ck M = Cq, i.e. M is the matrix geometric mean of Ck^-1 and Cq; A = M^(1/2).
Running a model to record those vectors, and caching the result per model, is the engine's
(engine/kv_calibration.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

CALIBRATION_VERSION = 1  # of this math: a cached calibration of another version is recomputed
SHRINKAGE = 0.01  # ridge added to each covariance, relative to its mean eigenvalue


@dataclass
class LayerCalibration:
    """Calibrated statistics of one layer (float32): means [Hkv, D], key transform [Hkv, D, D] or None."""

    key_mean: torch.Tensor | None = None  # before RoPE
    value_mean: torch.Tensor | None = None
    key_transform: torch.Tensor | None = None


@dataclass
class KVCalibration:
    """Per-layer statistics, float32: means [L, Hkv, D] (keys before RoPE), key transforms [L, Hkv, D, D]."""

    key_mean: torch.Tensor
    value_mean: torch.Tensor
    key_transform: torch.Tensor

    @classmethod
    def from_layers(cls, layers: list[LayerCalibration]) -> KVCalibration:
        """The layers' statistics stacked, first layer first."""
        return cls(torch.stack([layer.key_mean for layer in layers]),
                   torch.stack([layer.value_mean for layer in layers]),
                   torch.stack([layer.key_transform for layer in layers]))

    def layer(self, index: int) -> LayerCalibration:
        """The statistics of one layer, as the codecs take them."""
        return LayerCalibration(self.key_mean[index], self.value_mean[index], self.key_transform[index])

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"key_mean": self.key_mean, "value_mean": self.value_mean, "key_transform": self.key_transform}


def layer_statistics(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_before_rope: torch.Tensor,
                     rotate: Callable[[torch.Tensor], torch.Tensor]) -> LayerCalibration:
    """One layer's statistics from the queries [T, H, D], keys [T, Hkv, D] (after RoPE), values and keys
    before RoPE of T recorded tokens (float32); `rotate` applies RoPE at those tokens' positions to
    vectors [T, Hkv, D] (the model's rotary embedding)."""
    num_tokens, num_kv_heads = key.shape[:2]
    key_mean = key_before_rope[1:].mean(0)  # the first token is often an attention sink: leave it out
    value_mean = value[1:].mean(0)
    centered = key - rotate(key_mean.expand_as(key))
    use_mean = centered.pow(2).sum(-1, keepdim=True) < key.pow(2).sum(-1, keepdim=True)
    residual = torch.where(use_mean, centered, key)  # what the codec quantizes
    key_moment = torch.einsum("tgd,tge->gde", residual, residual) / num_tokens
    grouped = query.unflatten(1, (num_kv_heads, -1))  # [T, Hkv, group, D]
    query_moment = torch.einsum("tgjd,tgje->gde", grouped, grouped) / (num_tokens * grouped.shape[2])
    return LayerCalibration(key_mean, value_mean, key_transform_from_moments(key_moment, query_moment))


def _sqrtm(matrix: torch.Tensor) -> torch.Tensor:
    """Square root of symmetric positive definite matrices [..., D, D] (float64)."""
    eigenvalues, vectors = torch.linalg.eigh(matrix)
    return (vectors * eigenvalues.clamp_min(0).sqrt()[..., None, :]) @ vectors.transpose(-1, -2)


def _shrink(moment: torch.Tensor) -> torch.Tensor:
    d = moment.shape[-1]
    level = torch.diagonal(moment, dim1=-2, dim2=-1).mean(-1)[..., None, None]
    return moment + SHRINKAGE * level * torch.eye(d, dtype=moment.dtype)


def key_transform_from_moments(key_moment: torch.Tensor, query_moment: torch.Tensor) -> torch.Tensor:
    """A = M^(1/2), M the geometric mean of Ck^-1 and Cq ([..., D, D]), scaled so tr(A Ck A^T) = tr(Ck)."""
    ck, cq = _shrink(key_moment.double()), _shrink(query_moment.double())
    ck_half = _sqrtm(ck)
    ck_half_inv = torch.linalg.inv(ck_half)
    m = ck_half_inv @ _sqrtm(ck_half @ cq @ ck_half) @ ck_half_inv
    a = _sqrtm((m + m.transpose(-1, -2)) / 2)
    ratio = torch.diagonal(ck, dim1=-2, dim2=-1).sum(-1) / torch.diagonal(a @ ck @ a.transpose(-1, -2),
                                                                          dim1=-2, dim2=-1).sum(-1)
    return (a * ratio.sqrt()[..., None, None]).float()
