"""Mistral 3's eyes (Mistral Small 3.1 / 3.2): the Pixtral tower (models/vision/pixtral.py) and Mistral 3's
multimodal projector, as transformers' Mistral3MultiModalProjector computes it, and where a
Mistral3ForConditionalGeneration checkpoint's `vision_tower.*` / `multi_modal_projector.*` tensors go
(transformers 5 saves them under `model.`). The language model's tensors are left to the text family
(models/mistral3.py); localserve/loading/pixtral_vision.py reads a folder into `Mistral3Vision`.

The projector: the tower's patches RMS-normalised (the text config's eps), each picture's patch grid cut into
squares of spatial_merge_size^2 patches, row by row; a square's patches are laid side by side channel-major
(channel c of the patch at (i, j) in the square is value c * merge^2 + i * merge + j, as torch's `unfold`
orders them) and merged by a Linear into one vector; then Linear, activation, Linear into the language
model's hidden size.
"""

from __future__ import annotations

import torch
from localserve.models.layers.norms import RMSNorm
from localserve.models.vision.pixtral import ACTIVATION_FUNCTIONS, Mistral3VisionConfig, PixtralVisionTower
from torch import nn

PARTS = ("vision_tower.", "multi_modal_projector.")


class Mistral3PatchMerger(nn.Module):
    def __init__(self, config: Mistral3VisionConfig) -> None:
        super().__init__()
        hidden, self.merge = config.vision.hidden_size, config.spatial_merge_size
        self.merging_layer = nn.Linear(hidden * self.merge ** 2, hidden, bias=False)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """[all patches, hidden] of pictures with (rows, cols) patch grids -> [all tokens, hidden]."""
        merge, hidden = self.merge, patches.shape[-1]
        squares = []
        for picture, (rows, cols) in zip(patches.split([rows * cols for rows, cols in grids]), grids):
            grid = picture.view(rows // merge, merge, cols // merge, merge, hidden)
            # -> square row, square col, channel, row in square, col in square
            squares.append(grid.permute(0, 2, 4, 1, 3).reshape(-1, hidden * merge ** 2))
        return self.merging_layer(torch.cat(squares))


class Mistral3Projector(nn.Module):
    def __init__(self, config: Mistral3VisionConfig) -> None:
        super().__init__()
        hidden, text = config.vision.hidden_size, config.text_hidden_size
        self.norm = RMSNorm(hidden, config.norm_eps)
        self.patch_merger = Mistral3PatchMerger(config)
        self.linear_1 = nn.Linear(hidden, text, bias=config.projector_bias)
        self.linear_2 = nn.Linear(text, text, bias=config.projector_bias)
        self.act = ACTIVATION_FUNCTIONS[config.projector_act]

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        merged = self.patch_merger(self.norm(patches), grids)
        return self.linear_2(self.act(self.linear_1(merged)))


class Mistral3Vision(nn.Module):
    """Mistral 3's image encoder: pictures' pixel values -> the language model's input embeddings of each."""

    def __init__(self, config: Mistral3VisionConfig, processing=None) -> None:
        super().__init__()
        self.config = config
        self.processing = processing  # a PixtralImageProcessing (pixtral_preprocess.py), set by the loader
        self.vision_tower = PixtralVisionTower(config.vision, config.feature_layer)
        self.multi_modal_projector = Mistral3Projector(config)

    def _check(self, pictures: list[torch.Tensor]) -> None:
        if not pictures:
            raise ValueError("encode: no pictures")
        channels, side = self.config.vision.num_channels, self.config.token_pixels
        for index, picture in enumerate(pictures):
            if not isinstance(picture, torch.Tensor) or picture.dim() != 3 or picture.shape[0] != channels:
                shape = list(picture.shape) if isinstance(picture, torch.Tensor) else type(picture).__name__
                raise ValueError(f"encode: picture {index} must be [{channels}, height, width]; got {shape}")
            if not picture.is_floating_point():
                raise ValueError(f"encode: picture {index} must be floating point; got {picture.dtype}")
            height, width = picture.shape[1:]
            if height == 0 or width == 0 or height % side or width % side:
                raise ValueError(f"encode: picture {index} is {height} x {width} pixels; each side must be a "
                                 f"positive multiple of {side} (patch_size x spatial_merge_size)")

    @torch.no_grad()
    def encode(self, pictures: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pictures [channels, height, width] (sides multiples of patch_size x spatial_merge_size; each its own
        size) -> each one's embeddings [rows x cols tokens (row by row), text hidden], in the weights' dtype
        and on their device (`config.token_grid` gives rows and cols)."""
        self._check(pictures)
        weight = self.vision_tower.patch_conv.weight
        pictures = [picture.to(weight.device, weight.dtype) for picture in pictures]
        patch = self.config.vision.patch_size
        grids = [(picture.shape[1] // patch, picture.shape[2] // patch) for picture in pictures]
        features = self.multi_modal_projector(self.vision_tower(pictures), grids)
        merge = self.config.spatial_merge_size
        return list(features.split([rows * cols // merge ** 2 for rows, cols in grids]))


def checkpoint_target(name: str) -> str | None:
    """A checkpoint tensor's name in Mistral3Vision, or None for the tensors it does not take."""
    name = name.removeprefix("model.")
    return name if name.startswith(PARTS) else None
