"""The hash that names an image's content in the prefix cache's keys (engine/multimodal.py's
`ImageSpan.content_hash`), made alike by the server (server/request/images.py) and the offline API
(`LLM.chat`). No torch here: the server's request parsing imports it."""

from __future__ import annotations

import hashlib

from PIL import Image


def pixel_hash(picture: Image.Image) -> bytes:
    """Of the picture's size and pixels: RGB for an opaque picture, RGBA for one with transparency (an alpha
    band, or a palette's or grey image's transparent colour), since a model's processing lays it over white:
    two pictures whose colours agree but whose transparency differs are different pictures. The same pixels in
    another file format hash alike."""
    width, height = picture.size
    if "A" in picture.getbands() or picture.info.get("transparency") is not None:
        return hashlib.sha256(f"RGBA {width}x{height}:".encode() + picture.convert("RGBA").tobytes()).digest()
    return hashlib.sha256(f"{width}x{height}:".encode() + picture.convert("RGB").tobytes()).digest()
