"""A Qwen3.5/3.6 checkpoint folder's vision encoder (models/vision/qwen3_5_vision.py): the `model.visual.*`
tensors (or `visual.*`) of a Qwen3_5(Moe)ForConditionalGeneration folder, its config's `vision_config` and
vision token ids, and its image processor config. The language model loads apart (loading/hf.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from localserve.loading.vision import _read_json, load_vision_weights, processor_config
from localserve.models.vision.qwen3_5_vision import QwenVision, QwenVisionConfig, checkpoint_target, qwen_vision_config
from localserve.models.vision.qwen_preprocess import QwenImageProcessing, qwen_image_processing


def folder_qwen_processing(folder: Path, vision: QwenVisionConfig) -> QwenImageProcessing:
    """A folder's processing (loading/vision.py's `processor_config`), else Qwen2VLImageProcessor's defaults
    with the tower's patch sizes."""
    found = processor_config(folder)
    return qwen_image_processing(found[0], vision, found[1]) if found else qwen_image_processing({}, vision,
                                                                                               str(folder))


def load_qwen3_5_vision(folder: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> QwenVision:
    """The vision transformer and patch merger of a Qwen3_5(Moe)ForConditionalGeneration folder, in `dtype` on
    `device`, with the folder's image processing (`.processing`)."""
    folder = Path(folder)
    config = qwen_vision_config(_read_json(folder / "config.json"), str(folder / "config.json"))
    processing = folder_qwen_processing(folder, config)
    with torch.device("meta"):  # each weight is made once, in its place
        model = QwenVision(config, processing).to(dtype=dtype)
    model.to_empty(device=device)
    load_vision_weights(model, folder, checkpoint_target, f"the config has depth {config.depth}")
    return model.eval()
