"""Which vision encoder a checkpoint's images go through (models/vision/adapter.py's `ImageEncoder`), by its
config's architecture: each family adds its loader to `IMAGE_ENCODER_LOADERS`. `load_image_encoder` is called
beside the language model's load (localserve/llm.py); a checkpoint of another architecture, or one saved
without its vision weights, is served as text (None)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from localserve.models.vision.adapter import ImageEncoder
from localserve.models.vision.gemma3_encoder import load_gemma3_encoder

# A loader: (checkpoint folder, its config.json as a dict, dtype, device) -> the encoder, or None where the
# folder holds no vision weights; raises ModelLoadError naming the file and the problem.
EncoderLoader = Callable[[Path, dict, torch.dtype, torch.device | str], ImageEncoder | None]

IMAGE_ENCODER_LOADERS: dict[str, EncoderLoader] = {}  # by architecture (config.json's "architectures"[0])
IMAGE_ENCODER_LOADERS["Gemma3ForConditionalGeneration"] = load_gemma3_encoder


def load_image_encoder(path: Path, config: dict, dtype: torch.dtype,
                       device: torch.device | str) -> ImageEncoder | None:
    """The encoder of the checkpoint at `path` (a folder) whose config.json is `config`, or None (served as text)."""
    architectures = config.get("architectures") or [None]
    loader = IMAGE_ENCODER_LOADERS.get(architectures[0]) if path.is_dir() else None
    return loader(path, config, dtype, device) if loader is not None else None
