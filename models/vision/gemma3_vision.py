"""Gemma 3's eyes: the SigLIP tower and the projector of a Gemma3ForConditionalGeneration checkpoint, and
where its `vision_tower.*` / `multi_modal_projector.*` tensors go (transformers 5 may save them under
`model.`; older checkpoints put the tower's under `vision_tower.vision_model.`). The language model's
tensors are left to the text family (models/gemma3.py); the tower's pooling head (`head.*`), which
Gemma 3 never runs, is skipped. localserve/loading/vision.py reads a folder into `GemmaVision`."""

from __future__ import annotations

import torch
from localserve.models.vision.config import Gemma3VisionConfig
from localserve.models.vision.gemma3_projector import Gemma3Projector
from localserve.models.vision.preprocess import ImageProcessing
from localserve.models.vision.siglip import SiglipVisionTower
from torch import nn

PARTS = ("vision_tower.", "multi_modal_projector.")


class GemmaVision(nn.Module):
    """Gemma 3's image encoder: pixel values -> the language model's input embeddings of each image."""

    def __init__(self, config: Gemma3VisionConfig, processing: ImageProcessing | None = None) -> None:
        super().__init__()
        self.config = config
        size = config.vision.image_size
        self.processing = processing or ImageProcessing(height=size, width=size)
        self.vision_tower = SiglipVisionTower(config.vision)
        self.multi_modal_projector = Gemma3Projector(config)

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, image_size, image_size] -> [images, mm_tokens_per_image, text hidden], in the
        weights' dtype and on their device."""
        vision = self.config.vision
        expected = (vision.num_channels, vision.image_size, vision.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"encode: pixel_values must be [images, {', '.join(map(str, expected))}]; "
                             f"got {list(pixel_values.shape)}")
        if not pixel_values.is_floating_point():
            raise ValueError(f"encode: pixel_values must be floating point; got {pixel_values.dtype}")
        weight = self.vision_tower.embeddings.patch_embedding.weight
        patches = self.vision_tower(pixel_values.to(weight.device, weight.dtype))
        return self.multi_modal_projector(patches)


def checkpoint_target(name: str) -> str | None:
    """A checkpoint tensor's name in GemmaVision, or None for the tensors it does not take."""
    name = name.removeprefix("model.")
    if not name.startswith(PARTS):
        return None
    if name.startswith("vision_tower."):
        tower = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        return None if tower.startswith("head.") else "vision_tower." + tower
    return name
