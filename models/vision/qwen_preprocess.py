"""Qwen3.5/3.6's image processing with Pillow, as transformers' Qwen2VLImageProcessorPil computes it (the
Pillow backend transformers picks for `qwen3_5` / `qwen3_5_moe` without torchvision): each picture made RGB
(transparency laid over white), resized with its resample filter (bicubic by default) to the size
`smart_resize` picks, rescaled (x 1/255 in float64, then float32), normalised in float32, then cut into
patch rows: the patch grid walked in merge blocks (models/vision/qwen3_5_vision.py), each row a patch's
channels x temporal_patch_size x patch_size^2 values, the one frame of a still picture repeated
temporal_patch_size times. `image_grid_thw` is (1, height / patch_size, width / patch_size) per picture."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from localserve.models.vision.config import VisionConfigError
from localserve.models.vision.preprocess import ImageProcessing, image_processing, preprocess
from localserve.models.vision.qwen3_5_vision import QwenVisionConfig
from PIL import Image

# Qwen2VLImageProcessor's class defaults (OPENAI_CLIP_MEAN / _STD, 56 * 56 to 28 * 28 * 1280 pixels)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
DEFAULT_RESAMPLE = Image.Resampling.BICUBIC
MAX_ASPECT_RATIO = 200
STEP_FIELDS = ("resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
               "do_convert_rgb")


@dataclass(frozen=True)
class QwenImageProcessing:
    """How pictures become patch rows: sides resized to multiples of patch_size * merge_size with between
    min_pixels and max_pixels pixels, then the `pixels` steps (filter, rescale, normalisation; its height and
    width are set per picture)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    pixels: ImageProcessing = ImageProcessing(height=0, width=0, resample=DEFAULT_RESAMPLE, mean=CLIP_MEAN,
                                              std=CLIP_STD)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) a picture is resized to: each side the nearest multiple of `factor` (Python's
    round, halves to even), then, if the area leaves [min_pixels, max_pixels], both sides scaled by the
    same ratio (rounded down to multiples of `factor`, at least `factor`, when too big; up when too small).
    A picture more than 200 times longer than wide (or the reverse) is refused."""
    if height <= 0 or width <= 0:
        raise ValueError(f"smart_resize: the picture has no pixels ({width} x {height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"smart_resize: a {width} x {height} picture is more than {MAX_ASPECT_RATIO} times "
                         f"longer than wide")
    new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
    if new_height * new_width > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / shrink / factor) * factor)
        new_width = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_height * new_width < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_height, new_width = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return new_height, new_width


def _positive(config: dict[str, Any], name: str, default: int, source: str) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise VisionConfigError(f"{source}: {name} must be a positive integer; got {value!r}")
    return value


def qwen_image_processing(config: dict[str, Any], vision: QwenVisionConfig, source: str) -> QwenImageProcessing:
    """The processing a Qwen2VLImageProcessor config (`preprocessor_config.json`'s fields) describes for the
    tower `vision`; its class defaults for the fields left out, but the patch sizes, which default to the
    tower's. `source` names the file in errors."""
    size = config.get("size") or {}
    if not isinstance(size, dict):
        raise VisionConfigError(f"{source}: size must be an object with shortest_edge and longest_edge; got {size!r}")
    bounds = {"shortest_edge": size.get("shortest_edge", DEFAULT_MIN_PIXELS),
              "longest_edge": size.get("longest_edge", DEFAULT_MAX_PIXELS)}
    bounds["shortest_edge"] = config.get("min_pixels", bounds["shortest_edge"])  # the older spelling wins, as
    bounds["longest_edge"] = config.get("max_pixels", bounds["longest_edge"])  # in transformers' __init__
    min_pixels = _positive(bounds, "shortest_edge", 0, f"{source}: size")
    max_pixels = _positive(bounds, "longest_edge", 0, f"{source}: size")
    if min_pixels > max_pixels:
        raise VisionConfigError(f"{source}: min pixels {min_pixels} (size.shortest_edge) exceed max pixels "
                                f"{max_pixels} (size.longest_edge)")
    patches = {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
               "merge_size": vision.spatial_merge_size}
    for name, tower in patches.items():
        value = _positive(config, name, tower, source)
        if value != tower:
            raise VisionConfigError(f"{source}: {name} {value} differs from the vision tower's {tower}")
    if config.get("do_resize") is False:
        raise VisionConfigError(f"{source}: do_resize false is not supported (sides must be multiples of "
                                f"{vision.patch_size * vision.spatial_merge_size})")
    # the filter, rescale and normalisation fields read as for Gemma 3 (preprocess.py), with this class's defaults
    steps = {"resample": DEFAULT_RESAMPLE, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
    steps |= {name: value for name, value in config.items() if name in STEP_FIELDS and value is not None}
    pixels = image_processing(steps, 0, source)
    return QwenImageProcessing(**patches, min_pixels=min_pixels, max_pixels=max_pixels, pixels=pixels)


def _patch_rows(values: torch.Tensor, processing: QwenImageProcessing) -> torch.Tensor:
    """[channels, height, width] -> [grid_h * grid_w, channels * temporal * patch^2] in merge-block order."""
    channels, height, width = values.shape
    patch, merge = processing.patch_size, processing.merge_size
    blocks = values.reshape(channels, height // (patch * merge), merge, patch, width // (patch * merge), merge, patch)
    # -> block row, block col, row in block, col in block, channel, pixel row, pixel col
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)
    frames = blocks.unsqueeze(5).expand(*blocks.shape[:5], processing.temporal_patch_size, patch, patch)
    return frames.reshape((height // patch) * (width // patch), -1)


def qwen_preprocess(images: Sequence[Image.Image], processing: QwenImageProcessing
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pillow images (any size and mode) -> (pixel_values [all patches, channels * temporal_patch_size *
    patch_size^2] float32, image_grid_thw [images, 3] int64), as the processor's `pixel_values` and
    `image_grid_thw`."""
    if not images:
        raise ValueError("qwen_preprocess: no images")
    rows, grids = [], []
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(f"qwen_preprocess: image {index} is a {type(image).__name__}, not a PIL.Image.Image")
        try:
            height, width = smart_resize(image.height, image.width, processing.factor, processing.min_pixels,
                                         processing.max_pixels)
        except ValueError as exc:
            raise ValueError(f"qwen_preprocess: image {index}: {exc}") from None
        values = preprocess([image], replace(processing.pixels, height=height, width=width))[0]
        rows.append(_patch_rows(values, processing))
        grids.append((1, height // processing.patch_size, width // processing.patch_size))
    return torch.cat(rows), torch.tensor(grids, dtype=torch.int64)
