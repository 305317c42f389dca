"""Pixtral's image processing with Pillow, as transformers' PixtralImageProcessor computes it for Mistral 3
(its Pillow backend, with PixtralProcessor's patch size: the tower's patch_size x spatial_merge_size, the
side of one image token): a picture larger than the bound is scaled down by one ratio keeping its aspect
(each side floored), then each side is rounded up to a multiple of that patch size; the picture is made RGB,
resized there with the processor's filter, rescaled and normalised (models/vision/preprocess.py's steps).
Pictures are not padded to a common size: each keeps its own (transformers pads a batch and crops it back)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from localserve.models.vision.config import VisionConfigError
from localserve.models.vision.preprocess import ImageProcessing, image_processing, preprocess
from PIL import Image

# PixtralImageProcessor's class defaults (OPENAI_CLIP_MEAN / _STD, bicubic)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_RESAMPLE = Image.Resampling.BICUBIC
STEP_FIELDS = ("resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
               "do_convert_rgb")


@dataclass(frozen=True)
class PixtralImageProcessing:
    """How pictures become pixel values: at most max_height x max_width (`size`'s longest_edge, or its height
    and width), sides rounded up to multiples of `token_pixels`, then the `pixels` steps (its height and
    width are set per picture)."""

    max_height: int
    max_width: int
    token_pixels: int
    pixels: ImageProcessing = ImageProcessing(height=0, width=0, resample=DEFAULT_RESAMPLE, mean=CLIP_MEAN,
                                              std=CLIP_STD)


def pixtral_resize(height: int, width: int, max_height: int, max_width: int, multiple: int) -> tuple[int, int]:
    """The (height, width) a picture is resized to: when a side exceeds its bound, both divided by the larger
    ratio and floored; then each rounded up to a multiple of `multiple`. A picture so thin that a side
    floors to no pixel is refused (ValueError)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"pixtral_resize: the picture has no pixels ({width} x {height})")
    ratio = max(height / max_height, width / max_width)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
        if height == 0 or width == 0:
            raise ValueError(f"pixtral_resize: scaled into {max_width} x {max_height}, the picture would be "
                             f"{width} x {height} pixels (too long for its width)")
    return -(-height // multiple) * multiple, -(-width // multiple) * multiple


def _positive(value: Any, name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise VisionConfigError(f"{source}: {name} must be a positive integer; got {value!r}")
    return value


def _bounds(size: Any, default: int, source: str) -> tuple[int, int]:
    """(max height, max width) from a PixtralImageProcessor `size`: {"longest_edge": n} or height and width."""
    if size is None:
        return default, default
    if isinstance(size, dict) and size.get("longest_edge") is not None:
        edge = _positive(size["longest_edge"], "size.longest_edge", source)
        return edge, edge
    if isinstance(size, dict) and size.get("height") is not None and size.get("width") is not None:
        return _positive(size["height"], "size.height", source), _positive(size["width"], "size.width", source)
    raise VisionConfigError(f"{source}: size must hold longest_edge, or height and width; got {size!r}")


def _patch_side(value: Any, source: str) -> int:
    """A processor's patch_size: an int or {"height": n, "width": n}."""
    if isinstance(value, dict):
        if value.get("height") != value.get("width"):
            raise VisionConfigError(f"{source}: patch_size {value!r} must be square")
        value = value.get("height")
    return _positive(value, "patch_size", source)


def pixtral_image_processing(config: dict[str, Any], patch_size: int, spatial_merge_size: int, image_size: int,
                             source: str, processor: dict[str, Any] | None = None) -> PixtralImageProcessing:
    """The processing a PixtralImageProcessor config (`preprocessor_config.json`'s fields; `processor`: the
    PixtralProcessor's own fields, patch_size and spatial_merge_size, where the folder has them) describes
    for a tower of `patch_size` merged by `spatial_merge_size`; its class defaults for the fields left out,
    but the bound, which defaults to the tower's `image_size`. `source` names the file in errors."""
    processor = processor or {}
    for name, tower in (("patch_size", patch_size), ("spatial_merge_size", spatial_merge_size)):
        given = processor.get(name)
        if given is not None and _positive(given, name, source) != tower:
            raise VisionConfigError(f"{source}: the processor's {name} {given} differs from the model's {tower}")
    given = config.get("patch_size")
    # PixtralProcessor sets the image processor's patch size to the token's side; a bare image processor
    # config names the tower's patch (or already the token's side)
    if given is not None and _patch_side(given, source) not in (patch_size, patch_size * spatial_merge_size):
        raise VisionConfigError(f"{source}: patch_size {given!r} is neither the tower's {patch_size} nor an image "
                                f"token's side {patch_size * spatial_merge_size}")
    if config.get("do_resize") is False:
        raise VisionConfigError(f"{source}: do_resize false is not supported (sides must be multiples of "
                                f"{patch_size * spatial_merge_size})")
    if config.get("do_center_crop"):
        raise VisionConfigError(f"{source}: do_center_crop is not supported (Pixtral keeps the whole picture)")
    max_height, max_width = _bounds(config.get("size"), image_size, source)
    steps = {"resample": DEFAULT_RESAMPLE, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
    steps |= {name: value for name, value in config.items() if name in STEP_FIELDS and value is not None}
    return PixtralImageProcessing(max_height=max_height, max_width=max_width,
                                  token_pixels=patch_size * spatial_merge_size,
                                  pixels=image_processing(steps, 0, source))


def pixtral_preprocess(picture: Image.Image, processing: PixtralImageProcessing) -> torch.Tensor:
    """A Pillow picture (any size and mode) -> its pixel values [3, height, width] in float32, both sides
    multiples of `processing.token_pixels`."""
    if not isinstance(picture, Image.Image):
        raise TypeError(f"pixtral_preprocess: the picture is a {type(picture).__name__}, not a PIL.Image.Image")
    height, width = pixtral_resize(picture.height, picture.width, processing.max_height, processing.max_width,
                                   processing.token_pixels)
    return preprocess([picture], replace(processing.pixels, height=height, width=width))[0]
