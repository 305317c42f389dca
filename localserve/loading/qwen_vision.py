"""A Qwen3.5/3.6 checkpoint folder's vision encoder (models/vision/qwen3_5_vision.py): the `model.visual.*`
tensors (or `visual.*`) of a Qwen3_5(Moe)ForConditionalGeneration folder, its config's `vision_config` and
vision token ids, and its image processor config. The language model loads apart (loading/hf.py).
`load_qwen3_5_encoder` is the loader loading/image_encoders.py registers for both architectures."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from localserve.loading.vision import (
    _read_json,
    has_vision_tensors,
    load_vision_weights,
    processor_config,
)
from localserve.models.vision.qwen3_5_encoder import IMAGE_PAD, QwenImageEncoder
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


def image_token_text(folder: Path, token_id: int) -> str:
    """The text the folder's tokenizer gives the image token `token_id` (tokenizer_config.json's
    added_tokens_decoder, else tokenizer.json's added_tokens), else the released checkpoints' `<|image_pad|>`."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        text = config["added_tokens_decoder"][str(token_id)]["content"]
    except (OSError, ValueError, KeyError, TypeError):
        try:
            tokens = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
            text = next((token["content"] for token in tokens if token["id"] == token_id), None)
        except (OSError, ValueError, KeyError, TypeError):
            text = None  # the tokenizer's own loader names an unreadable file
    return text if isinstance(text, str) and text else IMAGE_PAD


def load_qwen3_5_encoder(path: Path, config: dict, dtype: torch.dtype,
                         device: torch.device | str) -> QwenImageEncoder | None:
    """The `ImageEncoder` of a Qwen3_5(Moe)ForConditionalGeneration folder (loading/image_encoders.py's loader
    signature), or None where its config has no vision_config or its shards no vision tensor (served as text)."""
    path = Path(path)
    if not isinstance(config.get("vision_config"), dict) or not has_vision_tensors(path, checkpoint_target):
        return None
    vision = load_qwen3_5_vision(path, dtype, device)
    return QwenImageEncoder(vision, image_token_text(path, vision.config.image_token_id))
