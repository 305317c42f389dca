"""Pictures for the vision tests: drawn (gradient, shapes, noise) in any Pillow mode, and re-encoded as a file
a server would receive."""

from __future__ import annotations

import io

import torch
from PIL import Image, ImageDraw


def picture(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A drawn picture (gradient, shapes, noise) in `mode`; RGBA/LA get a partly transparent alpha."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    image = Image.fromarray(noise.numpy(), "RGB")
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 5, height // 4, width * 3 // 4, height * 4 // 5), fill=(200, 30 + seed * 40, 90))
    draw.line((0, 0, width, height), fill=(10, 250, 10), width=max(1, width // 10))
    if mode in ("RGBA", "LA"):
        alpha = Image.linear_gradient("L").resize((width, height))
        image = image.convert("RGBA")
        image.putalpha(alpha)
        return image.convert(mode)
    if mode == "P_transparent":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
        return image
    return image.convert(mode)


def reencoded(image: Image.Image, fmt: str) -> Image.Image:
    """The picture written as a `fmt` file and opened again with Pillow, as a server receives it."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    buffer.seek(0)
    return Image.open(buffer)
