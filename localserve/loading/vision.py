"""A multimodal checkpoint folder's vision encoder (models/vision/): Gemma 3's SigLIP tower and projector
from a Gemma3ForConditionalGeneration folder's config, image processor config and safetensors shards. The
text part loads apart, as before (loading/hf.py with models/gemma3.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from localserve.loading.hf import ModelLoadError, safetensors_files
from localserve.models.vision.config import VisionConfigError, gemma3_vision_config
from localserve.models.vision.gemma3_vision import GemmaVision, checkpoint_target
from localserve.models.vision.preprocess import ImageProcessing, image_processing

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class VisionLoadError(ModelLoadError):
    """Vision weights that cannot be loaded; the message names the file and the tensor."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise VisionConfigError(f"{path}: missing file") from None
    except (OSError, ValueError) as exc:
        raise VisionConfigError(f"{path}: unreadable ({exc})") from None


def processor_config(folder: Path) -> tuple[dict, str] | None:
    """A checkpoint folder's image processor config and where it was read: `preprocessor_config.json`, else
    the `image_processor` part of `processor_config.json`; None where neither holds one."""
    for name in PROCESSOR_FILES:
        path = folder / name
        if not path.is_file():
            continue
        config = _read_json(path)
        config = config.get("image_processor", config) if name == "processor_config.json" else config
        if isinstance(config, dict) and ("size" in config or "image_processor_type" in config):
            return config, str(path)
    return None


def folder_image_processing(folder: Path, image_size: int) -> ImageProcessing:
    """A checkpoint folder's processing (`processor_config`), else Gemma3ImageProcessor's defaults at the
    tower's size."""
    found = processor_config(folder)
    return image_processing(*found[:1], image_size, found[1]) if found else ImageProcessing(height=image_size,
                                                                                            width=image_size)


def _vision_tensors(folder: Path, target: Callable[[str], str | None]) -> Iterator[tuple[str, str, Path, torch.Tensor]]:
    """(our name, the file's name, the file, the tensor) for each vision tensor of the folder's shards."""
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                    ours = target(name)
                    if ours is not None:
                        yield ours, name, file, shard.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise VisionLoadError(f"{file}: unreadable safetensors file ({exc})") from None


def has_vision_tensors(folder: Path, target: Callable[[str], str | None]) -> bool:
    """Whether the folder's shards hold any vision tensor (`target`: a checkpoint name -> ours, None: not one);
    only their headers are read."""
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as shard:
                if any(target(name) is not None for name in shard.keys()):  # noqa: SIM118 - not a dict
                    return True
        except (SafetensorError, OSError) as exc:
            raise VisionLoadError(f"{file}: unreadable safetensors file ({exc})") from None
    return False


def load_vision_weights(model: torch.nn.Module, folder: Path, target: Callable[[str], str | None],
                        size_note: str) -> None:
    """Read every vision tensor of `folder` (`target`: a checkpoint name -> ours, None: not a vision tensor)
    into `model`'s parameters, each once; VisionLoadError names an unexpected, misshapen or missing tensor
    (`size_note`: what the config says of the model's size, for the message)."""
    wanted = dict(model.named_parameters())
    seen: set[str] = set()
    for ours, name, file, tensor in _vision_tensors(folder, target):
        parameter = wanted.get(ours)
        if parameter is None:
            raise VisionLoadError(f"{file}: unexpected vision tensor {name} ({size_note})")
        if tuple(tensor.shape) != tuple(parameter.shape):
            raise VisionLoadError(f"{file}: {name} has shape {list(tensor.shape)}; the config gives "
                                  f"{list(parameter.shape)}")
        with torch.no_grad():
            parameter.copy_(tensor)
        seen.add(ours)
    missing = sorted(set(wanted) - seen)
    if missing:
        raise VisionLoadError(f"{folder}: missing vision tensors: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def load_gemma_vision(folder: str | Path, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> GemmaVision:
    """The vision tower and projector of a Gemma3ForConditionalGeneration folder, in `dtype` on `device`,
    with the folder's image processing (`.processing`)."""
    folder = Path(folder)
    config = gemma3_vision_config(_read_json(folder / "config.json"), str(folder / "config.json"))
    processing = folder_image_processing(folder, config.vision.image_size)
    with torch.device("meta"):  # no weights made twice: each is read once into its place
        model = GemmaVision(config, processing).to(dtype=dtype)
    model.to_empty(device=device)
    load_vision_weights(model, folder, checkpoint_target, f"the config has {config.vision.num_layers} layers")
    return model.eval()
