"""Gemma 3's image processing with Pillow, as transformers' Gemma3ImageProcessor computes it (its Pillow
backend, which transformers uses without torchvision): the image made RGB (transparency composited onto
white), resized to the processor's size with its resample filter, rescaled (x 1/255 in float64, then
float32), normalised by the processor's mean and std in float32, channels first. Pan-and-scan crops are
not made (the checkpoints leave them off); a processor config that asks for them is refused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from localserve.models.vision.config import VisionConfigError
from PIL import Image

# Gemma3ImageProcessor's class defaults (IMAGENET_STANDARD_MEAN / _STD), for fields its config leaves out
DEFAULT_MEAN = (0.5, 0.5, 0.5)
DEFAULT_STD = (0.5, 0.5, 0.5)
DEFAULT_RESAMPLE = Image.Resampling.BILINEAR
DEFAULT_RESCALE = 1 / 255


@dataclass(frozen=True)
class ImageProcessing:
    """How pictures become pixel values: `height` x `width` after resizing with `resample` (a Pillow filter),
    then x `rescale_factor` (None: not rescaled) and (x - mean) / std (None: not normalised)."""

    height: int
    width: int
    resample: Image.Resampling = DEFAULT_RESAMPLE
    rescale_factor: float | None = DEFAULT_RESCALE
    mean: tuple[float, ...] | None = DEFAULT_MEAN
    std: tuple[float, ...] | None = DEFAULT_STD
    convert_rgb: bool = True


def _channel_values(value: Any, field: str, source: str) -> tuple[float, ...]:
    values = [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if (not isinstance(values, (list, tuple)) or len(values) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
        raise VisionConfigError(f"{source}: {field} must be a number or 3 numbers (R, G, B); got {value!r}")
    return tuple(float(v) for v in values)


def image_processing(config: dict[str, Any], image_size: int, source: str) -> ImageProcessing:
    """The processing a Gemma3ImageProcessor config (`preprocessor_config.json`'s fields) describes, for a
    tower of `image_size` pixels; `source` names the file in errors."""
    size = config.get("size") or {"height": image_size, "width": image_size}
    if not isinstance(size, dict) or (size.get("height"), size.get("width")) != (image_size, image_size):
        raise VisionConfigError(f"{source}: size {size!r} must be {{'height': {image_size}, 'width': {image_size}}}, "
                                f"the vision tower's image_size")
    if config.get("do_resize") is False:
        raise VisionConfigError(f"{source}: do_resize false is not supported (the tower takes {image_size} x "
                                f"{image_size} pixels)")
    if config.get("do_pan_and_scan"):
        raise VisionConfigError(f"{source}: do_pan_and_scan is not supported")
    resample = config.get("resample")
    try:
        resample = DEFAULT_RESAMPLE if resample is None else Image.Resampling(resample)
    except ValueError:
        raise VisionConfigError(f"{source}: resample {resample!r} is not a Pillow filter; one of "
                                f"{[int(r) for r in Image.Resampling]}") from None
    factor = config.get("rescale_factor", DEFAULT_RESCALE)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise VisionConfigError(f"{source}: rescale_factor must be a positive number; got {factor!r}")
    normalize = config.get("do_normalize") is not False
    mean = _channel_values(config.get("image_mean", DEFAULT_MEAN), "image_mean", source) if normalize else None
    std = _channel_values(config.get("image_std", DEFAULT_STD), "image_std", source) if normalize else None
    if std is not None and 0.0 in std:
        raise VisionConfigError(f"{source}: image_std {list(std)} has a zero")
    return ImageProcessing(height=image_size, width=image_size, resample=resample,
                           rescale_factor=None if config.get("do_rescale") is False else float(factor),
                           mean=mean, std=std, convert_rgb=config.get("do_convert_rgb") is not False)


def to_rgb(image: Image.Image) -> Image.Image:
    """The picture in RGB; a picture with transparency (an alpha band, or a palette's or grey image's
    transparent colour) is first laid over white, as transformers' processors do."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        over = Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image.convert("RGBA"))
        return over.convert("RGB")
    return image.convert("RGB")


def preprocess(images: Sequence[Image.Image], processing: ImageProcessing) -> torch.Tensor:
    """Pillow images (any size and mode) -> pixel values [images, 3, height, width] in float32."""
    if not images:
        raise ValueError("preprocess: no images")
    pixels = []
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(f"preprocess: image {index} is a {type(image).__name__}, not a PIL.Image.Image")
        if processing.convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"preprocess: image {index} is in mode {image.mode!r}; RGB needed without convert_rgb")
        image = image.resize((processing.width, processing.height), resample=processing.resample)
        values = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # [3, height, width], uint8
        if processing.rescale_factor is not None:
            values = (values.double() * processing.rescale_factor).float()
        else:
            values = values.float()
        if processing.mean is not None and processing.std is not None:
            mean = torch.tensor(processing.mean, dtype=torch.float32).view(3, 1, 1)
            std = torch.tensor(processing.std, dtype=torch.float32).view(3, 1, 1)
            values = (values - mean) / std
        pixels.append(values)
    return torch.stack(pixels)
