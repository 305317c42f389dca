"""A Qwen3.5/3.6 checkpoint folder's vision encoder (models/vision/qwen3_5_vision.py): the `model.visual.*`
tensors (or `visual.*`) of a Qwen3_5(Moe)ForConditionalGeneration folder, its config's `vision_config` and
vision token ids, and its image processor config. The language model loads apart (loading/hf.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from localserve.loading.hf import safetensors_files
from localserve.loading.vision import PROCESSOR_FILES, VisionLoadError, _read_json
from localserve.models.vision.qwen3_5_vision import QwenVision, QwenVisionConfig, checkpoint_target, qwen_vision_config
from localserve.models.vision.qwen_preprocess import QwenImageProcessing, qwen_image_processing


def folder_qwen_processing(folder: Path, vision: QwenVisionConfig) -> QwenImageProcessing:
    """A folder's processing: `preprocessor_config.json`, else the `image_processor` part of
    `processor_config.json`, else Qwen2VLImageProcessor's defaults with the tower's patch sizes."""
    for name in PROCESSOR_FILES:
        path = folder / name
        if not path.is_file():
            continue
        config = _read_json(path)
        config = config.get("image_processor", config) if name == "processor_config.json" else config
        if isinstance(config, dict) and ("size" in config or "image_processor_type" in config):
            return qwen_image_processing(config, vision, str(path))
    return qwen_image_processing({}, vision, str(folder))


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
    wanted = dict(model.named_parameters())
    seen: set[str] = set()
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                    ours = checkpoint_target(name)
                    if ours is None:
                        continue
                    target = wanted.get(ours)
                    if target is None:
                        raise VisionLoadError(f"{file}: unexpected vision tensor {name} (the config has depth "
                                              f"{config.depth})")
                    tensor = shard.get_tensor(name)
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise VisionLoadError(f"{file}: {name} has shape {list(tensor.shape)}; the config gives "
                                              f"{list(target.shape)}")
                    with torch.no_grad():
                        target.copy_(tensor)
                    seen.add(ours)
        except (SafetensorError, OSError) as exc:
            raise VisionLoadError(f"{file}: unreadable safetensors file ({exc})") from None
    missing = sorted(set(wanted) - seen)
    if missing:
        raise VisionLoadError(f"{folder}: missing vision tensors: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return model.eval()
