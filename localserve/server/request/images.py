"""The images a request carries, checked and decoded into the neutral `ImageInput` (no I/O here).

Every API's image part ends here: its bytes as base64 text (an Ollama `images` entry, an Anthropic
`source.data`) or a `data:` URL (OpenAI's `image_url`, Responses' `input_image`), decoded with Pillow
(never a hand-written decoder) within `ImageBounds`: bytes per image, bytes of every image together,
images per request, pixels per image. The pixel bound is checked from the file's header before its
pixels are decoded, with Pillow's own decompression-bomb guard left on (it refuses beyond twice
`Image.MAX_IMAGE_PIXELS`, whatever the bound here), so a small file that claims a huge picture is
refused quickly and with bounded memory. A URL that points elsewhere (`http(s)`) is
refused: a desktop server does not fetch for a client. Every refusal is a `ProtocolError` naming the
part's JSON path (`where`), and the message says only what was wrong with the client's own data.

A request's images travel as `PlacedImage`s: which input message holds each one (its index in
`GenerationRequest.input_messages`; for a prompt tokenized as it is, 0 is the prompt) and at which
character of that message's text it stands (the text parts before it, joined). `with_image_parts` turns
such messages back into the multimodal content chat templates take (text and `{"type": "image"}` parts).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image, UnidentifiedImageError

from localserve.engine.image_hash import pixel_hash
from localserve.server.request.image_cache import DECODED_FILE_BYTES, DECODED_FILES, BytesLRU, DecodedFile
from localserve.server.request.validation import ProtocolError, shown

# Pillow's format name -> ours (the media type is image/<ours>)
FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
MEDIA_TYPES = {f"image/{name}": name for name in FORMATS.values()}
SUPPORTED = "PNG, JPEG, WebP or GIF"
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),", re.ASCII)
_WHITESPACE = re.compile(rb"[ \t\r\n]+")
NO_FETCHING = ("the server does not fetch images for a client: send the image inline as a data URL "
               "(data:image/png;base64,...)")


@dataclass(frozen=True)
class ImageBounds:
    """Bounds on the images of one request (documented in docs/PROTOCOL.md; `localserve serve` flags)."""

    max_bytes: int = 10 << 20  # one image's file, decoded from base64 (--max-image-bytes)
    max_total_bytes: int = 20 << 20  # every image of the request together (--max-request-image-bytes)
    max_images: int = 16  # images in one request (--max-images)
    max_pixels: int = 1 << 25  # width x height of one image, read from its header (--max-image-pixels)

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_total_bytes", "max_images", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"ImageBounds.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_body_bytes(self) -> int:
        """What the request body may hold besides its text for the images within these bounds: their
        base64 text and a data URL's head for each."""
        return -(-self.max_total_bytes // 3) * 4 + 256 * self.max_images


@dataclass(frozen=True)
class ImageInput:
    """One decoded image of a request: the file as sent and what Pillow read of it."""

    data: bytes  # the encoded file as sent
    format: str  # "png", "jpeg", "webp", "gif"
    width: int
    height: int
    sha256: bytes  # of the decoded pixels (RGBA where transparent) and the size, not of the file (image_hash.py)
    where: str  # the part's JSON path, e.g. "messages[1].content[0]"

    def picture(self) -> Image.Image:
        """The picture's first frame as decoded, in its own mode (not converted): a model's preprocessing makes it
        RGB as its processor does (transparency over white)."""
        with Image.open(io.BytesIO(self.data)) as image:
            image.seek(0)
            image.load()
            return image.copy()  # the file closes with the block; the copy keeps its pixels, palette and info

    def rgb(self) -> Image.Image:
        """The picture as RGB pixels (its first frame), for a model's preprocessing."""
        with Image.open(io.BytesIO(self.data)) as image:
            image.seek(0)
            return image.convert("RGB")


@dataclass(frozen=True)
class PlacedImage:
    """An image and where it stands: input message `message`, before the character `offset` of its text."""

    message: int
    offset: int
    image: ImageInput


def with_image_parts(messages: list[dict], images: Sequence[PlacedImage], first: int = 0) -> list[dict]:
    """`messages` with the content of each one that holds images as chat templates take it (transformers'
    multimodal form): a list of `{"type": "text", "text"}` and `{"type": "image"}` parts, in order. `first`: the
    index in `messages` of input message 0 (the stored conversation, or a system prompt, before it). The others
    are returned as they are; so is `messages` when there are no images."""
    if not images:
        return messages
    by_message: dict[int, list[PlacedImage]] = {}
    for placed in images:
        by_message.setdefault(first + placed.message, []).append(placed)
    out = []
    for index, message in enumerate(messages):
        placed_here = by_message.get(index)
        if placed_here is None:
            out.append(message)
            continue
        text, parts, start = message["content"], [], 0
        for placed in sorted(placed_here, key=lambda item: item.offset):  # stable: equal offsets keep their order
            if placed.offset > start:
                parts.append({"type": "text", "text": text[start:placed.offset]})
            parts.append({"type": "image"})
            start = placed.offset
        if start < len(text):
            parts.append({"type": "text", "text": text[start:]})
        out.append({**message, "content": parts})
    return out


def decode_image(data: bytes, where: str, bounds: ImageBounds, media_type: str | None = None,
                 cache: BytesLRU[bytes, DecodedFile] | None = DECODED_FILES) -> ImageInput:
    """`data` (an image file) decoded within `bounds`; `media_type`, when the client declared one, must be the
    file's. A ProtocolError naming `where` for anything else: whatever a decoder raises on a client's bytes is
    that client's broken image, never the server's failure. A file `cache` (image_cache.py) holds is not decoded
    again: its entry is checked against the bounds as the decoded file is, and gives the same ImageInput."""
    if len(data) > bounds.max_bytes:
        raise ProtocolError("image_too_large", f"'{where}' is an image of {len(data)} bytes; at most "
                            f"{bounds.max_bytes} are accepted per image", where)
    if cache is None:
        return _decode(data, where, bounds, media_type)
    key = hashlib.sha256(data).digest()
    found = cache.get(key)
    if found is None:
        image = _decode(data, where, bounds, media_type)
        cache.put(key, DecodedFile(image.format, image.width, image.height, image.sha256), DECODED_FILE_BYTES)
        return image
    _check_header(found.format, found.width, found.height, where, bounds, media_type)
    return ImageInput(data=data, format=found.format, width=found.width, height=found.height, sha256=found.sha256,
                      where=where)


def _decode(data: bytes, where: str, bounds: ImageBounds, media_type: str | None) -> ImageInput:
    """`decode_image` without a cache: the file opened and decoded with Pillow."""
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError:  # Pillow's own guard: beyond twice Image.MAX_IMAGE_PIXELS
        raise _too_many_pixels(where, bounds, None) from None
    except UnidentifiedImageError:
        raise ProtocolError("invalid_image", f"'{where}' is not an image this server reads ({SUPPORTED})",
                            where) from None
    except Exception as exc:  # noqa: BLE001 - a decoder's error on the client's bytes
        raise _undecodable(where, exc) from None
    with image:
        return _decoded(image, data, where, bounds, media_type)


def _decoded(image: Image.Image, data: bytes, where: str, bounds: ImageBounds, media_type: str | None) -> ImageInput:
    """The ImageInput of an opened `image` whose header has been read (its pixels not yet decoded)."""
    kind = FORMATS[image.format]
    width, height = image.size
    _check_header(kind, width, height, where, bounds, media_type)
    try:
        image.seek(0)
        image.load()
        digest = pixel_hash(image)
    except Image.DecompressionBombError:
        raise _too_many_pixels(where, bounds, (width, height)) from None
    except Exception as exc:  # noqa: BLE001 - a decoder's error on the client's bytes
        raise _undecodable(where, exc) from None
    return ImageInput(data=data, format=kind, width=width, height=height, sha256=digest, where=where)


def _check_header(kind: str, width: int, height: int, where: str, bounds: ImageBounds, media_type: str | None) -> None:
    """The checks on what a file's header says (a decoded file's, or a cached entry's): its declared media type,
    some pixels, and no more than the bound."""
    if media_type is not None and MEDIA_TYPES.get(media_type) != kind:
        raise ProtocolError("invalid_image", f"'{where}' is a {kind.upper()} image, not the declared "
                            f"{shown(media_type)}", where)
    if width < 1 or height < 1:
        raise ProtocolError("invalid_image", f"'{where}' is an image of no pixels ({width}x{height})", where)
    if width * height > bounds.max_pixels:  # from the header: no pixel decoded yet
        raise _too_many_pixels(where, bounds, (width, height))


def _undecodable(where: str, exc: Exception) -> ProtocolError:
    return ProtocolError("invalid_image", f"'{where}' does not decode as an image: {_reason(exc)}", where)


def _too_many_pixels(where: str, bounds: ImageBounds, size: tuple[int, int] | None) -> ProtocolError:
    said = f" of {size[0]}x{size[1]} pixels" if size is not None else ""
    return ProtocolError("image_too_large", f"'{where}' is an image{said} beyond the bound of {bounds.max_pixels} "
                         "pixels per image", where)


def _reason(exc: BaseException) -> str:
    """Pillow's reason, short; never a path or a traceback (the file is the client's own bytes)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return shown(text, 120).strip('"')


def decode_base64(text: object, where: str, bounds: ImageBounds) -> bytes:
    """The bytes of base64 `text` (line breaks tolerated); too long a text is refused before it is decoded."""
    if not isinstance(text, str):
        raise ProtocolError("invalid_type", f"'{where}' must be the image as base64 text, got {shown(text)}", where)
    if len(text) > -(-bounds.max_bytes // 3) * 4 + len(text) // 76 * 2 + 4:
        raise ProtocolError("image_too_large", f"'{where}' holds {len(text)} characters of base64: more than an "
                            f"image of {bounds.max_bytes} bytes, the bound per image", where)
    raw = text.encode("ascii", errors="replace")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        try:
            data = base64.b64decode(_WHITESPACE.sub(b"", raw), validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("invalid_image", f"'{where}' is not valid base64", where) from None
    if not data:
        raise ProtocolError("invalid_image", f"'{where}' is empty", where)
    return data


def read_image_url(url: object, where: str, bounds: ImageBounds) -> bytes:
    """The file of a `data:image/...;base64,` URL; an `http(s)` URL is refused (the server fetches nothing)."""
    if not isinstance(url, str):
        raise ProtocolError("invalid_type", f"'{where}' must be a data URL, got {shown(url)}", where)
    scheme = url[:16].split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme in ("http", "https"):
        raise ProtocolError("invalid_image_url", f"'{where}' is an {scheme} URL: {NO_FETCHING}", where)
    head = _DATA_URL.match(url[:512]) if scheme == "data" else None
    if head is None:
        raise ProtocolError("invalid_image_url", f"'{where}' must be a data URL (data:image/png;base64,...), got "
                            f"{shown(url, 40)}", where)
    mime = head["mime"].strip().lower()
    if mime not in MEDIA_TYPES:
        raise ProtocolError("invalid_image", f"'{where}' is of media type {shown(mime)}; this server reads "
                            f"{', '.join(MEDIA_TYPES)}", where)
    if "base64" not in (param.strip().lower() for param in head["params"].split(";")):
        raise ProtocolError("invalid_image_url", f"'{where}' must be a base64 data URL (data:{mime};base64,...)",
                            where)
    # The declared type is not held against the file: clients often label any image image/jpeg.
    return decode_base64(url[head.end():], where, bounds)


def check_media_type(media_type: object, where: str) -> str:
    """A declared media type this server reads (Anthropic's `source.media_type`)."""
    if media_type not in MEDIA_TYPES:
        raise ProtocolError("invalid_image", f"'{where}' must be one of {', '.join(MEDIA_TYPES)}, got "
                            f"{shown(media_type)}", where)
    return media_type  # type: ignore[return-value]


DETAILS = ("auto", "low", "high", "original")  # OpenAI's `detail`: accepted; the model's processor sets the size


def check_detail(part: dict, where: str) -> None:
    """OpenAI's `detail` of an image part, when sent: one of DETAILS (the model's own processing sets the size)."""
    detail = part.get("detail")
    if detail is not None and detail not in DETAILS:
        raise ProtocolError("invalid_value", f"'{where}.detail' must be one of {', '.join(DETAILS)}, got "
                            f"{shown(detail)}", f"{where}.detail")


@dataclass
class ImageSink:
    """The images of one request as its parts are read: counted and summed against `bounds` before each is
    decoded, then placed."""

    bounds: ImageBounds
    placed: list[PlacedImage] = field(default_factory=list)
    total_bytes: int = 0

    def reserve(self, where: str) -> None:
        """Refuse one more image beyond the request's bound (before its base64 is even decoded)."""
        if len(self.placed) >= self.bounds.max_images:
            raise ProtocolError("too_many_images", f"'{where}' is image {len(self.placed) + 1} of the request; at "
                                f"most {self.bounds.max_images} are accepted", where)

    def place(self, data: bytes, where: str, message: int, offset: int, media_type: str | None = None) -> None:
        """Decode the file `data` of part `where` and place it in input message `message` at `offset`."""
        self.reserve(where)
        if self.total_bytes + len(data) > self.bounds.max_total_bytes:
            raise ProtocolError("image_too_large", f"'{where}' brings the request's images to "
                                f"{self.total_bytes + len(data)} bytes; at most {self.bounds.max_total_bytes} are "
                                "accepted", where)
        image = decode_image(data, where, self.bounds, media_type)
        self.total_bytes += len(data)
        self.placed.append(PlacedImage(message, offset, image))
