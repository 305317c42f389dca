"""Image parts for the image fuzzers (tests/helpers/image_fuzzing.py), as each API spells them, with the codes the
server may refuse each with on its own (docs/PROTOCOL.md's "Images"): valid pictures of many sizes, modes and
formats (none: accepted by a model that takes images), and broken files, decompression bombs, unsupported formats,
wrong media types, URLs to fetch and wrong types, under the run's small bounds (`VISION_BOUNDS`)."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from dataclasses import dataclass

from hypothesis import strategies as st
from PIL import Image

from localserve.server.request.images import ImageBounds
from tests.helpers.pictures import picture

# The run's bounds, small, so that the fuzzer reaches each of them with files that fit its bodies.
VISION_BOUNDS = ImageBounds(max_bytes=3000, max_total_bytes=6000, max_images=3, max_pixels=48 * 48)
# Every code an image part may be refused with (docs/PROTOCOL.md, "Images").
IMAGE_CODES = frozenset({"invalid_image", "invalid_image_url", "image_too_large", "too_many_images",
                         "invalid_type", "invalid_value", "unsupported_value", "invalid_prompt"})


def _file(image: Image.Image, kind: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=kind, **options)
    return out.getvalue()


def _flat(size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    return Image.new(mode, size, 77 if mode in ("L", "1", "I", "I;16", "P") else (40, 90, 200, 128)[:len(mode)])


def _png(width: int, height: int, idat: bytes | None = None, crc_ok: bool = True) -> bytes:
    """A PNG whose header says width x height (grey), over `idat` (a few zeros: a decompression bomb)."""
    def chunk(kind: bytes, body: bytes, ok: bool = True) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) ^ (not ok))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) + chunk(
        b"IDAT", zlib.compress(b"\0" * 16) if idat is None else idat, crc_ok) + chunk(b"IEND", b"")


def _animated_gif() -> bytes:
    frames = [_flat((9, 7)), Image.new("RGB", (9, 7), (250, 0, 0))]
    return _file(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)


def _valid_files() -> dict[str, tuple[bytes, str]]:
    """Pictures the server must accept: (file, its media type) by name."""
    files = {
        "png 1x1": (_file(_flat((1, 1)), "PNG"), "png"),
        "png 48x48 at the pixel bound": (_file(_flat((48, 48)), "PNG"), "png"),
        "png 1x2304 at the pixel bound": (_file(_flat((1, 2304)), "PNG"), "png"),
        "jpeg 2304x1": (_file(_flat((2304, 1)), "JPEG"), "jpeg"),
        "png RGBA drawn": (_file(picture(12, 9, seed=1, mode="RGBA"), "PNG"), "png"),
        "png LA": (_file(picture(8, 8, seed=2, mode="LA"), "PNG"), "png"),
        "png palette with transparency": (_file(picture(10, 6, seed=3, mode="P_transparent"), "PNG"), "png"),
        "png 1-bit": (_file(picture(16, 16, seed=4, mode="1"), "PNG"), "png"),
        "png 16-bit grey": (_file(_flat((5, 5), "I;16"), "PNG"), "png"),
        "jpeg grey": (_file(picture(8, 8, seed=5, mode="L"), "JPEG"), "jpeg"),
        "jpeg CMYK": (_file(_flat((8, 8), "CMYK"), "JPEG"), "jpeg"),
        "jpeg drawn": (_file(picture(20, 14, seed=6), "JPEG", quality=60), "jpeg"),
        "webp RGBA": (_file(picture(6, 9, seed=7, mode="RGBA"), "WEBP"), "webp"),
        "webp lossless": (_file(_flat((11, 3)), "WEBP", lossless=True), "webp"),
        "gif": (_file(picture(7, 7, seed=8, mode="P"), "GIF"), "gif"),
        "gif animated": (_animated_gif(), "gif"),
    }
    for name, (data, _) in files.items():
        assert len(data) <= VISION_BOUNDS.max_bytes, (name, len(data))
    return files


def _broken_files() -> dict[str, tuple[bytes, str, frozenset[str]]]:
    """Files the server must refuse: (file, the media type it claims, the codes it may be refused with)."""
    png = _file(picture(12, 9, seed=9), "PNG")
    jpeg = _file(picture(12, 9, seed=9), "JPEG")
    bad, large = frozenset({"invalid_image"}), frozenset({"image_too_large"})
    return {
        "png cut short": (png[:40], "png", bad),
        "png cut in its pixels": (png[:-30], "png", bad),
        "jpeg cut short": (jpeg[:-200], "jpeg", bad),
        "png bad checksum": (_png(4, 4, crc_ok=False), "png", bad),
        "png of no pixels": (_png(0, 7), "png", bad),
        "png bomb 100000x100000": (_png(100_000, 100_000), "png", large),
        "png 49x48 past the pixel bound": (_file(_flat((49, 48)), "PNG"), "png", large),
        "gif 2305x1 past the pixel bound": (_file(_flat((2305, 1), "P"), "GIF"), "gif", large),
        "png of noise past the byte bound": (_file(picture(40, 40, seed=10), "PNG"), "png", large),
        "bmp": (_file(_flat((2, 2)), "BMP"), "png", bad),
        "tiff": (_file(_flat((2, 2)), "TIFF"), "png", bad),
        "gif header only": (b"GIF89a", "gif", bad),
        "png signature only": (b"\x89PNG\r\n\x1a\n", "png", bad),
        "text": (b"hello, I am no picture", "png", bad),
        "svg": (b'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>', "png", bad),
    }


VALID_FILES = _valid_files()
BROKEN_FILES = _broken_files()
KINDS = {data: kind for data, kind, *_ in (*VALID_FILES.values(), *BROKEN_FILES.values())}  # file -> format


@dataclass(frozen=True)
class DrawnImage:
    """One image part's content as drawn: the bytes it carries (None: no file reaches the decoder) and the codes
    it may be refused with on its own (empty: a picture the server must accept)."""

    name: str
    data: bytes | None
    media_type: str
    codes: frozenset[str]


VALID = st.sampled_from([DrawnImage(name, data, kind, frozenset()) for name, (data, kind) in VALID_FILES.items()])
FILES = VALID | VALID | st.sampled_from([DrawnImage(name, data, kind, codes)
                                         for name, (data, kind, codes) in BROKEN_FILES.items()])
# base64 texts that are no file: (text, codes)
BAD_TEXTS = st.sampled_from([("", {"invalid_image"}), ("%%%", {"invalid_image"}), ("aGk", {"invalid_image"}),
                             ("A" * 4100, {"image_too_large"}), (5, {"invalid_type"}), (None, {"invalid_type"}),
                             (["aGk="], {"invalid_type"})])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------- each API's image part
@st.composite
def chat_image_part(draw, clean: bool) -> tuple[dict, frozenset[str], int | None]:
    """An OpenAI chat `image_url` part: (part, the codes it may get on its own, its file's size or None); `clean`:
    a valid picture, rightly sent."""
    image = draw(VALID if clean else FILES)
    good_mimes = st.sampled_from(["image/png", "image/jpeg", "image/webp", "image/gif", "IMAGE/PNG"])
    mime = draw(good_mimes if clean else good_mimes | st.sampled_from(["image/bmp", "text/plain", ""]))
    codes, size = set(image.codes), len(image.data)
    if mime.lower() not in ("image/png", "image/jpeg", "image/webp", "image/gif"):
        codes.add("invalid_image")
    url = f"data:{mime};base64,{b64(image.data)}"
    mutation = None if clean else draw(st.sampled_from([None] * 3 + [
        "no base64", "https", "http", "file", "not a string", "bad detail", "no url"]))
    part: dict = {"type": "image_url", "image_url": {"url": url}}
    if mutation == "no base64":
        part["image_url"]["url"], codes = url.replace(";base64", ""), codes | {"invalid_image_url"}
    elif mutation in ("https", "http", "file"):
        part["image_url"]["url"], codes = f"{mutation}://127.0.0.1/cat.png", {"invalid_image_url"}
    elif mutation == "not a string":
        part["image_url"]["url"], codes = 5, {"invalid_type"}
    elif mutation == "no url":
        part["image_url"], codes = url, {"invalid_type"}
    elif mutation == "bad detail":
        part["image_url"]["detail"], codes = "huge", codes | {"invalid_value"}
    else:
        detail = draw(st.sampled_from([None, "auto", "low", "high", "original"]))
        if detail is not None:
            part["image_url"]["detail"] = detail
    return part, frozenset(codes), size if mutation not in ("https", "http", "file", "not a string", "no url") \
        else None


@st.composite
def responses_image_part(draw, clean: bool) -> tuple[dict, frozenset[str], int | None]:
    """A Responses `input_image` part (the chat part's URL, or a `file_id`)."""
    chat, codes, size = draw(chat_image_part(clean))
    if not clean and draw(st.integers(0, 5)) == 0:
        return {"type": "input_image", "file_id": "file-1"}, frozenset({"unsupported_value", "invalid_type"}), None
    inner = chat["image_url"]
    part = {"type": "input_image", **({"image_url": inner["url"]} if isinstance(inner, dict) else {"image_url": 7})}
    if isinstance(inner, dict) and "detail" in inner:
        part["detail"] = inner["detail"]
    return part, codes, size


@st.composite
def base64_image(draw, clean: bool) -> tuple[object, frozenset[str], int | None]:
    """An Ollama `images` entry: a file's base64 text (sometimes cut with line breaks), or a bad text."""
    if not clean and draw(st.integers(0, 3)) == 0:
        text, codes = draw(BAD_TEXTS)
        return text, frozenset(codes), None
    image = draw(VALID if clean else FILES)
    text = b64(image.data)
    if draw(st.booleans()):
        text = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    return text, image.codes, len(image.data)


@st.composite
def anthropic_image_block(draw, clean: bool) -> tuple[dict, frozenset[str], int | None]:
    """An Anthropic `image` block: base64 with its media type (the file's, or another), or a url/file source."""
    kind = "base64" if clean else draw(st.sampled_from(["base64"] * 3 + ["url", "file"]))
    if kind != "base64":
        source = {"type": kind, "url": "https://example.com/a.png"} if kind == "url" else {"type": kind,
                                                                                            "file_id": "file-1"}
        return {"type": "image", "source": source}, frozenset(IMAGE_CODES - {"invalid_prompt"}), None
    data, codes, size = draw(base64_image(clean))
    image_kind = draw(st.sampled_from(["png", "jpeg", "webp", "gif"]))
    declared = "own" if clean else draw(st.sampled_from(["own", "own", "other", "bmp"]))
    media_type = "image/bmp" if declared == "bmp" else None
    codes = set(codes)
    if declared == "own" and size is not None:
        media_type = f"image/{_named_kind(data)}"
    if media_type is None:
        media_type = f"image/{image_kind}"
        if size is not None and image_kind != _named_kind(data):
            codes.add("invalid_image")
    if declared == "bmp" or (declared == "own" and size is None):
        codes.add("invalid_image")
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}, \
        frozenset(codes), size


def _named_kind(text) -> str:
    """The media type name a drawn base64 text's file has (its format; png for a file no decoder reads)."""
    return KINDS.get(base64.b64decode("".join(text.split())), "png")
