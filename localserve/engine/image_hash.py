"""The hash that names an image's content in the prefix cache's keys (engine/multimodal.py's
`ImageSpan.content_hash`), made alike by the server (server/request/images.py) and the offline API
(`LLM.chat`). No torch here: the server's request parsing imports it."""

from __future__ import annotations

import hashlib

from PIL import Image


def pixel_hash(picture: Image.Image) -> bytes:
    """Of the picture's size and RGB pixels (the same picture in another file format hashes alike)."""
    width, height = picture.size
    return hashlib.sha256(f"{width}x{height}:".encode() + picture.convert("RGB").tobytes()).digest()
