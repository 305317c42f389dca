"""Images in requests (server/request/images.py and each API's image part): real PNG, JPEG, WebP and GIF
files made with Pillow here, parsed on every API into the neutral `ImageInput` and placed in their message;
every bound at its limit and one past it; a decompression bomb refused fast with bounded memory; broken
parts (bad base64, no image, a format not read, a wrong media type, a URL to fetch) refused with a 400
naming the part. A generated test places random text and image parts and checks every offset."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import time
import tracemalloc
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from localserve.server.anthropic.format import MESSAGES as ANTHROPIC
from localserve.server.ollama.format import OLLAMA_CHAT, OLLAMA_GENERATE
from localserve.server.openai.completions_format import CHAT_COMPLETIONS
from localserve.server.openai.responses_format import RESPONSES_HTTP
from localserve.server.request.fields import parse_request
from localserve.server.request.generation_request import RequestLimits
from localserve.server.request.images import ImageBounds, decode_image, with_image_parts
from localserve.server.request.validation import ProtocolError


def image_file(kind: str = "PNG", size: tuple[int, int] = (4, 3), color=(200, 30, 10), **save) -> bytes:
    """A real image file of `kind` made with Pillow; its top-left pixel black, the rest `color`."""
    image = Image.new("RGB", size, color)
    image.putpixel((0, 0), (0, 0, 0))
    out = io.BytesIO()
    image.save(out, format=kind, **save)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (8-bit grey) and whose data is a few bytes: decoding it would
    need width x height bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(
        b"IEND", b"")


PNG = image_file("PNG")


def refused(call, code: str, param: str) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        call()
    assert caught.value.status == 400 and caught.value.code == code and caught.value.param == param, (
        caught.value.code, caught.value.param, caught.value.message)
    assert param in caught.value.message
    return caught.value


# ------------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("kind, ours, save", [("PNG", "png", {}), ("JPEG", "jpeg", {"quality": 95}),
                                              ("WEBP", "webp", {"lossless": True}), ("GIF", "gif", {})])
def test_each_format_decodes_into_an_image_input(kind, ours, save):
    data = image_file(kind, (5, 7), **save)
    image = decode_image(data, "messages[0].content[1]", ImageBounds())
    assert (image.format, image.width, image.height, image.data) == (ours, 5, 7, data)
    assert image.where == "messages[0].content[1]"
    with Image.open(io.BytesIO(data)) as reference:
        pixels = reference.convert("RGB").tobytes()
    assert image.sha256 == hashlib.sha256(b"5x7:" + pixels).digest()
    assert image.rgb().tobytes() == pixels


def test_the_hash_is_of_the_pixels_not_the_file():
    png, webp = image_file("PNG", (6, 6)), image_file("WEBP", (6, 6), lossless=True)
    assert png != webp
    assert decode_image(png, "a", ImageBounds()).sha256 == decode_image(webp, "b", ImageBounds()).sha256
    changed = Image.open(io.BytesIO(png)).convert("RGB")
    changed.putpixel((5, 5), (201, 30, 10))  # one pixel, one level
    out = io.BytesIO()
    changed.save(out, format="PNG")
    assert decode_image(out.getvalue(), "c", ImageBounds()).sha256 != decode_image(png, "a", ImageBounds()).sha256
    # the same pixels in another shape differ too
    assert decode_image(image_file("PNG", (3, 12)), "d", ImageBounds()).sha256 != decode_image(
        image_file("PNG", (12, 3)), "e", ImageBounds()).sha256


@pytest.mark.parametrize("data, reason", [
    (b"hello, not an image", "is not an image this server reads"),
    (image_file("BMP"), "is not an image this server reads"),  # a format not read
    (PNG[:len(PNG) // 2], "does not decode"),  # cut short
    (image_file("JPEG")[:40], "does not decode"),
])
def test_a_file_that_is_no_readable_image_is_refused(data, reason):
    error = refused(lambda: decode_image(data, "images[0]", ImageBounds()), "invalid_image", "images[0]")
    assert reason in error.message


def test_the_bytes_bound_at_its_limit_and_one_past():
    assert decode_image(PNG, "x", ImageBounds(max_bytes=len(PNG))).width == 4
    refused(lambda: decode_image(PNG, "x", ImageBounds(max_bytes=len(PNG) - 1)), "image_too_large", "x")


def test_the_pixel_bound_at_its_limit_and_one_past():
    data = image_file("PNG", (10, 10))
    assert decode_image(data, "x", ImageBounds(max_pixels=100)).height == 10
    error = refused(lambda: decode_image(data, "x", ImageBounds(max_pixels=99)), "image_too_large", "x")
    assert "10x10 pixels" in error.message


@pytest.mark.parametrize("width, height", [(100_000, 100_000), (20_000, 20_000), ((1 << 31) - 1, 1)])
def test_a_decompression_bomb_is_refused_fast_with_bounded_memory(width, height):
    data = bomb_png(width, height)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        refused(lambda: decode_image(data, "messages[0].images[0]", ImageBounds()), "image_too_large",
                "messages[0].images[0]")
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5 and peak < 1 << 20, (elapsed, peak)


# ------------------------------------------------------------------------------------------- each API
def parse(wire, body, **bounds):
    return parse_request(body, wire, RequestLimits(images=ImageBounds(**bounds)))


def chat(*parts, text_first="look: "):
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": text_first}, *parts]}]}


def image_url(data: bytes, mime: str = "image/png", **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime), **extra}}


def test_chat_completions_image_url_parts():
    jpeg = image_file("JPEG")
    request = parse(CHAT_COMPLETIONS, chat(image_url(PNG, detail="low"), {"type": "text", "text": "and"},
                                           image_url(jpeg, "image/jpeg")))
    assert request.input_messages[1]["content"] == "look: and"
    assert [(placed.message, placed.offset, placed.image.format, placed.image.where) for placed in request.images] == [
        (1, 6, "png", "messages[1].content[1]"), (1, 9, "jpeg", "messages[1].content[3]")]
    assert request.images[1].image.data == jpeg


def test_responses_input_image_parts():
    webp = image_file("WEBP")
    body = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(webp, "image/webp"), "detail": "auto"},
        {"type": "input_text", "text": "what is this?"}]}]}
    request = parse(RESPONSES_HTTP, body)
    [placed] = request.images
    assert (placed.message, placed.offset, placed.image.format, placed.image.where) == (
        0, 0, "webp", "input[0].content[0]")


def test_ollama_chat_and_generate_images():
    gif = image_file("GIF")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "hello"},
                                       {"role": "user", "content": "what are these?", "images": [b64(PNG), b64(gif)]}]}
    request = parse(OLLAMA_CHAT, body)
    assert [(p.message, p.offset, p.image.format, p.image.where) for p in request.images] == [
        (2, 0, "png", "messages[2].images[0]"), (2, 0, "gif", "messages[2].images[1]")]
    generated = parse(OLLAMA_GENERATE, {"model": "m", "prompt": "describe", "images": [b64(PNG)]})
    assert generated.input_messages == [{"role": "user", "content": "describe"}]
    assert [(p.message, p.offset, p.image.where) for p in generated.images] == [(0, 0, "images[0]")]
    # images with no prompt still ask for an answer; raw keeps them with its prompt
    assert parse(OLLAMA_GENERATE, {"model": "m", "images": [b64(PNG)]}).has_input
    raw = parse(OLLAMA_GENERATE, {"model": "m", "prompt": "<img> what", "raw": True, "images": [b64(PNG)]})
    assert raw.prompt == "<img> what" and len(raw.images) == 1


def test_anthropic_image_blocks_keep_their_paths():
    source = {"type": "base64", "media_type": "image/jpeg", "data": b64(image_file("JPEG"))}
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "screen:"}, {"type": "image", "source": source}]},
            {"type": "text", "text": "see "}, {"type": "image", "source": source}]}]}
    request = parse(ANTHROPIC, body)
    roles = [message["role"] for message in request.input_messages]
    assert roles == ["user", "assistant", "tool", "user"]
    assert [(p.message, p.offset, p.image.where) for p in request.images] == [
        (2, 7, "messages[2].content[0].content[1]"), (3, 4, "messages[2].content[2]")]


# ------------------------------------------------------------------------------------------- refusals
BAD_PARTS = [
    # (wire, body, code, param)
    (CHAT_COMPLETIONS, chat({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
     "invalid_image_url", "messages[1].content[1].image_url.url"),
    (CHAT_COMPLETIONS, chat({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}),
     "invalid_type", "messages[1].content[1].image_url"),
    (CHAT_COMPLETIONS, chat({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}),
     "invalid_image_url", "messages[1].content[1].image_url.url"),
    (CHAT_COMPLETIONS, chat({"type": "image_url", "image_url": {"url": data_url(PNG, "image/tiff")}}),
     "invalid_image", "messages[1].content[1].image_url.url"),
    (CHAT_COMPLETIONS, chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}),
     "invalid_image", "messages[1].content[1].image_url.url"),
    (CHAT_COMPLETIONS, chat({"type": "image_url", "image_url": {"url": data_url(b"not a picture")}}),
     "invalid_image", "messages[1].content[1]"),
    (CHAT_COMPLETIONS, chat(image_url(PNG, detail="huge")), "invalid_value", "messages[1].content[1].image_url.detail"),
    (CHAT_COMPLETIONS, chat({"type": "input_audio", "input_audio": {}}), "unsupported_value",
     "messages[1].content[1]"),
    (RESPONSES_HTTP, {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "unsupported_value", "input[0].content[0].file_id"),
    (RESPONSES_HTTP, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://example.com/a.png"}]}]}, "invalid_image_url",
     "input[0].content[0].image_url"),
    (OLLAMA_CHAT, {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["not base64!"]}]},
     "invalid_image", "messages[0].images[0]"),
    (OLLAMA_CHAT, {"model": "m", "messages": [{"role": "user", "content": "x", "images": [5]}]},
     "invalid_type", "messages[0].images[0]"),
    (OLLAMA_CHAT, {"model": "m", "messages": [{"role": "user", "content": "x", "images": b64(PNG)}]},
     "invalid_type", "messages[0].images"),
    (OLLAMA_GENERATE, {"model": "m", "prompt": "x", "images": [b64(b"GIF89a broken")]}, "invalid_image", "images[0]"),
    (ANTHROPIC, {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": b64(image_file("JPEG"))}}]}]},
     "invalid_image", "messages[0].content[0]"),  # a wrong media_type
    (ANTHROPIC, {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/bmp", "data": b64(PNG)}}]}]},
     "invalid_image", "messages[0].content[0].source.media_type"),
    (ANTHROPIC, {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}]}]}, "invalid_image_url", "messages[0].content[0].source"),
    (ANTHROPIC, {"model": "m", "max_tokens": 1, "messages": [{"role": "assistant", "content": [
        {"type": "image", "source": {}}]}]}, "unsupported_value", "messages[0].content[0]"),
]


@pytest.mark.parametrize("wire, body, code, param", BAD_PARTS)
def test_a_broken_image_part_is_refused_naming_it(wire, body, code, param):
    error = refused(lambda: parse(wire, body), code, param)
    assert "Traceback" not in error.message and len(error.message) < 400


def test_an_http_url_says_the_server_does_not_fetch():
    error = refused(lambda: parse(CHAT_COMPLETIONS, chat({"type": "image_url", "image_url": {
        "url": "http://127.0.0.1/secret.png"}})), "invalid_image_url", "messages[1].content[1].image_url.url")
    assert "does not fetch" in error.message and "data URL" in error.message


def test_the_count_bound_at_its_limit_and_one_past():
    images = [b64(PNG)] * 3
    body = {"model": "m", "messages": [{"role": "user", "content": "x", "images": images[:2]},
                                       {"role": "user", "content": "y", "images": images[2:]}]}
    assert len(parse(OLLAMA_CHAT, body, max_images=3).images) == 3
    error = refused(lambda: parse(OLLAMA_CHAT, body, max_images=2), "too_many_images", "messages[1].images[0]")
    assert "at most 2" in error.message


def test_the_request_bytes_bound_at_its_limit_and_one_past():
    body = {"model": "m", "prompt": "x", "images": [b64(PNG)] * 2}
    assert len(parse(OLLAMA_GENERATE, body, max_total_bytes=2 * len(PNG)).images) == 2
    refused(lambda: parse(OLLAMA_GENERATE, body, max_total_bytes=2 * len(PNG) - 1), "image_too_large", "images[1]")


def test_base64_longer_than_the_bytes_bound_is_refused_before_decoding():
    text = "A" * 4_000_000
    refused(lambda: parse(OLLAMA_GENERATE, {"model": "m", "prompt": "x", "images": [text]}, max_bytes=1000),
            "image_too_large", "images[0]")


def test_a_bomb_on_the_wire_is_refused_naming_its_part():
    body = chat({"type": "image_url", "image_url": {"url": data_url(bomb_png(100_000, 100_000))}})
    start = time.perf_counter()
    refused(lambda: parse(CHAT_COMPLETIONS, body), "image_too_large", "messages[1].content[1]")
    assert time.perf_counter() - start < 0.5


def test_image_bounds_must_be_positive():
    with pytest.raises(ValueError, match="max_images"):
        ImageBounds(max_images=0)


# ------------------------------------------------------------------------------------------- generated
texts = st.text(alphabet="ab é", max_size=5)
parts = st.lists(st.one_of(texts.map(lambda text: ("text", text)), st.sampled_from(["PNG", "JPEG", "WEBP"]).map(
    lambda kind: ("image", kind))), max_size=6)
FILES = {kind: image_file(kind, (3, 2)) for kind in ("PNG", "JPEG", "WEBP")}


@settings(max_examples=60, deadline=None, database=None)
@given(messages=st.lists(parts, min_size=1, max_size=3))
def test_generated_parts_are_placed_at_their_text_offsets(messages):
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": value} if kind == "text" else image_url(FILES[value]) for kind, value in message]}
        for message in messages]}
    expected, count = [], 0
    for index, message in enumerate(messages):
        offset = 0
        for number, (kind, value) in enumerate(message):
            if kind == "text":
                offset += len(value)
            else:
                count += 1
                expected.append((index, offset, value.lower(), f"messages[{index}].content[{number}]"))
    if count > 4:
        refused(lambda: parse(CHAT_COMPLETIONS, body, max_images=4), "too_many_images", next(
            f"messages[{index}].content[{number}]" for index, number in _image_paths(messages)[4:5]))
        return
    request = parse(CHAT_COMPLETIONS, body, max_images=4)
    assert [(p.message, p.offset, p.image.format, p.image.where) for p in request.images] == expected
    for message, sent in zip(request.input_messages, messages, strict=True):
        assert message["content"] == "".join(value for kind, value in sent if kind == "text")
    for shaped, sent in zip(with_image_parts(request.input_messages, request.images), messages, strict=True):
        if any(kind == "image" for kind, _ in sent):  # the parts as sent, empty texts left out, neighbours joined
            expected_parts = []
            for kind, value in sent:
                if kind == "image":
                    expected_parts.append({"type": "image"})
                elif value and expected_parts and expected_parts[-1]["type"] == "text":
                    expected_parts[-1] = {"type": "text", "text": expected_parts[-1]["text"] + value}
                elif value:
                    expected_parts.append({"type": "text", "text": value})
            assert shaped["content"] == expected_parts


def _image_paths(messages):
    return [(index, number) for index, message in enumerate(messages)
            for number, (kind, _) in enumerate(message) if kind == "image"]


@settings(max_examples=200, deadline=None, database=None)
@given(kind=st.sampled_from(list(FILES)), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)),
                                                          max_size=4), cut=st.none() | st.integers(0, 400))
def test_a_mangled_file_is_an_image_or_a_clear_refusal(kind, flips, cut):
    data = bytearray(FILES[kind])
    for position, mask in flips:
        data[position % len(data)] ^= mask
    data = bytes(data[:cut] if cut is not None else data)
    try:
        image = decode_image(data, "images[0]", ImageBounds(max_pixels=1 << 16))
    except ProtocolError as error:
        assert error.status == 400 and error.param == "images[0]" and error.code in ("invalid_image",
                                                                                   "image_too_large"), error
    else:
        assert image.width * image.height <= 1 << 16 and len(image.sha256) == 32


def test_with_image_parts_gives_templates_their_multimodal_content():
    body = chat(image_url(PNG), {"type": "text", "text": "and"}, image_url(PNG), image_url(PNG))
    request = parse(CHAT_COMPLETIONS, body)
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"}]
    shaped = with_image_parts(history + request.input_messages, request.images, first=len(history))
    assert shaped[:3] == [*history, request.input_messages[0]]  # untouched: no images there
    assert shaped[3] == {"role": "user", "content": [
        {"type": "text", "text": "look: "}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
        {"type": "image"}]}
    assert with_image_parts(history, ()) is history
