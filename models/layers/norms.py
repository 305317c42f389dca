"""RMSNorm as Hugging Face computes it: normalised in float32 (at least), scaled in the run dtype (Llama's
form); Gemma's form scales in float32 by (offset + w), or not at all."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = nn.functional.rms_norm(x if x.dtype in (torch.float32, torch.float64) else x.float(),
                                        (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (offset + w), all in float32 then cast back (Gemma 3: offset 1, Gemma 4: 0); without
    `scale`, x / rms(x) alone (Gemma 4's value and router norms)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, scale: bool = True) -> None:
        super().__init__()
        if scale:
            self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x if x.dtype == torch.float64 else x.float()
        normed = nn.functional.rms_norm(wide, (x.shape[-1],), eps=self.eps)
        if hasattr(self, "weight"):
            normed = normed * (self.offset + self.weight.to(wide.dtype))
        return normed.to(x.dtype)
