"""RMSNorm as Hugging Face computes it: normalised in float32 (at least), scaled in the run dtype."""

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
