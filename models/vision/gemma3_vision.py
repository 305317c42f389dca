"""Gemma 3's eyes: the SigLIP tower and the projector of a Gemma3ForConditionalGeneration folder, read from
its `vision_tower.*` / `multi_modal_projector.*` tensors (transformers 5 may save them under `model.`;
older checkpoints put the tower's under `vision_tower.vision_model.`). The language model's tensors are
left to the text loader (models/gemma3.py); the tower's pooling head (`head.*`), which Gemma 3 never
runs, is skipped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from localserve.models.vision.config import Gemma3VisionConfig, VisionConfigError, gemma3_vision_config
from localserve.models.vision.gemma3_projector import Gemma3Projector
from localserve.models.vision.preprocess import ImageProcessing, folder_image_processing
from localserve.models.vision.siglip import SiglipVisionTower
from safetensors import SafetensorError, safe_open
from torch import nn

from localserve.loading.hf import ModelLoadError, safetensors_files

PARTS = ("vision_tower.", "multi_modal_projector.")


class VisionLoadError(ModelLoadError):
    """Vision weights that cannot be loaded; the message names the file and the tensor."""


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


def our_name(name: str) -> str | None:
    """A checkpoint tensor's name in GemmaVision, or None for the tensors it does not take."""
    name = name.removeprefix("model.")
    if not name.startswith(PARTS):
        return None
    if name.startswith("vision_tower."):
        tower = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        return None if tower.startswith("head.") else "vision_tower." + tower
    return name


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise VisionConfigError(f"{path}: missing (not a Hugging Face checkpoint folder)") from None
    except (OSError, ValueError) as exc:
        raise VisionConfigError(f"{path}: unreadable ({exc})") from None


def _vision_tensors(folder: Path) -> Iterator[tuple[str, str, Path, torch.Tensor]]:
    """(our name, the file's name, the file, the tensor) for each vision tensor of the folder's shards."""
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                    ours = our_name(name)
                    if ours is not None:
                        yield ours, name, file, shard.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise VisionLoadError(f"{file}: unreadable safetensors file ({exc})") from None


def load_gemma_vision(folder: str | Path, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> GemmaVision:
    """The vision tower and projector of a Gemma3ForConditionalGeneration folder, in `dtype` on `device`,
    with the folder's image processing (`.processing`)."""
    folder = Path(folder)
    config = gemma3_vision_config(_read_config(folder), str(folder / "config.json"))
    processing = folder_image_processing(folder, config.vision.image_size)
    with torch.device("meta"):  # no weights made twice: each is read once into its place
        model = GemmaVision(config, processing).to(dtype=dtype)
    model.to_empty(device=device)
    wanted = dict(model.named_parameters())
    seen: set[str] = set()
    for ours, name, file, tensor in _vision_tensors(folder):
        target = wanted.get(ours)
        if target is None:
            raise VisionLoadError(f"{file}: unexpected vision tensor {name} (the config has "
                                  f"{config.vision.num_layers} layers)")
        if tuple(tensor.shape) != tuple(target.shape):
            raise VisionLoadError(f"{file}: {name} has shape {list(tensor.shape)}; the config gives "
                                  f"{list(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        seen.add(ours)
    missing = sorted(set(wanted) - seen)
    if missing:
        raise VisionLoadError(f"{folder}: missing vision tensors: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return model.eval()
