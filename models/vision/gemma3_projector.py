"""Gemma 3's multimodal projector (transformers' Gemma3MultiModalProjector): the tower's patch grid is
average-pooled in squares to `mm_tokens_per_image` tokens (row by row), normalised by an RMSNorm that
scales by (1 + w) in float32, and multiplied by `mm_input_projection_weight` [vision hidden, text hidden]
into the language model's embedding space."""

from __future__ import annotations

import torch
from localserve.models.layers.norms import GemmaRMSNorm
from localserve.models.vision.config import Gemma3VisionConfig
from torch import nn
from torch.nn import functional as F


class Gemma3Projector(nn.Module):
    def __init__(self, config: Gemma3VisionConfig) -> None:
        super().__init__()
        vision = config.vision
        self.side, self.kernel = vision.patches_per_side, config.pool_kernel
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, offset=1.0)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, config.text_hidden_size))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, mm_tokens_per_image, text hidden]."""
        images, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(images, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(patches.dtype)
