"""Image parts for the fuzzers' run against a model that takes images (a tiny Gemma 3), with what the server must
make of each: valid pictures of many sizes, modes and formats (accepted), and broken files, decompression
bombs, unsupported formats, wrong media types, URLs to fetch, wrong types, too many and too big images (each
refused with its documented code, naming the part: docs/PROTOCOL.md's "Images").

A drawn request is a `VisionCase`: the API's path and body, and its oracle. The server checks a request's
images in the order they stand (counted before each is decoded), so the first part that is wrong, or that
crosses a request's bound, is the one its 400 names; a request whose parts are all right is answered (200).
"""

from __future__ import annotations

import base64
import http.client
import io
import itertools
import json
import re
import socket
import struct
import zlib
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from hypothesis import strategies as st
from PIL import Image

from localserve.server.request.images import ImageBounds
from tests.helpers.pictures import picture
from tests.helpers.server import CLOSING_EVENTS

# The run's bounds, small, so that the fuzzer reaches each of them with files that fit its bodies.
VISION_BOUNDS = ImageBounds(max_bytes=3000, max_total_bytes=6000, max_images=3, max_pixels=48 * 48)
# Every code an image part may be refused with (docs/PROTOCOL.md, "Images").
IMAGE_CODES = frozenset({"invalid_image", "invalid_image_url", "image_too_large", "too_many_images",
                         "invalid_type", "invalid_value", "unsupported_value", "invalid_prompt"})
HOSTILE_TEXTS = st.text(max_size=12) | st.sampled_from([
    "<start_of_image>", "<image_soft_token>" * 3, "<end_of_image>", "<start_of_turn>user\n", "<end_of_turn>", "",
    "\x00", "\ud800", "é" * 30, "what is in the picture?"])


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


# ---------------------------------------------------------------------------------- requests and their oracle
@dataclass(frozen=True)
class VisionCase:
    """A request with image parts and what must come of it: 200 (`refused_at` None), or a 4xx whose `param` names
    one of `refused_at`'s parts (JSON paths) with one of its codes."""

    path: str
    body: dict
    refused_at: tuple[tuple[str, frozenset[str]], ...] | None
    # where the chat template may refuse a request whose parts are all right (`invalid_prompt`): images in a
    # system or assistant turn, which Gemma 3's template drops (naming the image) or fails on (naming the field)
    may_refuse: tuple[str, ...] = ()

    def check_refusal(self, status: int, code: str | None, param: str | None) -> None:
        """A refusal by the rules: expected, with a documented code, naming the part that is wrong."""
        refused_at = self.refused_at or tuple((where, frozenset({"invalid_prompt"})) for where in self.may_refuse)
        assert refused_at, f"a request the server must answer was refused: {status} {code} {param}"
        assert 400 <= status < 500 and code in IMAGE_CODES, (status, code, param)
        assert param is not None and any(re.match(re.escape(where) + r"($|\.)", param) and code in codes
                                         for where, codes in refused_at), (code, param, refused_at)

    def encoded(self) -> tuple[str, bytes]:
        return self.path, json.dumps(self.body).encode()


def _oracle(parts: list[tuple[str, frozenset[str], int | None]], texts: list[tuple[str, str]]) \
        -> tuple[tuple[str, frozenset[str]], ...] | None:
    """Where the refusal must point for `parts` ((where, own codes, file size) in the order the server reads
    them) and `texts` ((where, text)): a text holding a lone surrogate (the body is checked for those first);
    else the first part that is wrong on its own, is past the request's count, or brings its bytes past the
    request's total; None when every part is right."""
    invalid = _surrogates(texts)
    if invalid:
        return invalid
    total = 0
    for number, (where, codes, size) in enumerate(parts):
        codes = set(codes)
        if number >= VISION_BOUNDS.max_images:
            codes.add("too_many_images")
        if size is not None and not codes and total + size > VISION_BOUNDS.max_total_bytes:
            codes.add("image_too_large")
        if codes:
            return ((where, frozenset(codes)),)
        total += size or 0
    return None


def _surrogates(texts: list[tuple[str, str]]) -> tuple[tuple[str, frozenset[str]], ...]:
    """The texts holding a lone surrogate (invalid Unicode: refused before anything else is read)."""
    return tuple((where, frozenset({"invalid_value"})) for where, text in texts
                 if any(0xD800 <= ord(character) <= 0xDFFF for character in text))


def _text(draw, where: str, texts: list[tuple[str, str]]) -> str:
    """A hostile text at `where`, noted in `texts`."""
    text = draw(HOSTILE_TEXTS)
    texts.append((where, text))
    return text


def _content(draw, part_strategy, right, where: str, text_type: str, counts: list[int], texts: list) \
        -> tuple[list, list]:
    """A message's content: text parts of hostile text and image parts (each drawn from `part_strategy(right())`,
    `right()` saying whether it is drawn right; `counts`: how many), in any order."""
    count = draw(st.sampled_from(counts))
    kinds = draw(st.permutations(["image"] * count + ["text"] * draw(st.integers(0, 2))))
    content, parts = [], []
    for kind in kinds:
        if kind == "text":
            content.append({"type": text_type, "text": _text(draw, f"{where}.content[{len(content)}]", texts)})
            continue
        part, codes, size = draw(part_strategy(right()))
        parts.append((f"{where}.content[{len(content)}]", codes, size))
        content.append(part)
    return content, parts


OPENAI_CONTENT = ("chat", "apply_template", "responses", "responses_socket")  # images in any role's content


def _roles(draw, api: str, clean: bool) -> list[str]:
    """The turns of a conversation Gemma 3's template takes (alternating, ending with the user's); now and then a
    system turn first (OpenAI's)."""
    turns = 1 if clean else draw(st.sampled_from([1, 1, 3]))
    roles = ["user" if turn % 2 == 0 else "assistant" for turn in range(turns)]
    if not clean and api in OPENAI_CONTENT and draw(st.integers(0, 3)) == 0:
        roles.insert(0, draw(st.sampled_from(["system", "developer"])))
    return roles


@st.composite
def vision_cases(draw, apis: tuple[str, ...]) -> VisionCase:
    """A request with image parts to one of `apis` ("chat", "apply_template", "responses", "responses_socket" (a
    follow-up of the last stored response now and then), "ollama_chat", "ollama_generate", "anthropic",
    "anthropic_count"), in a conversation Gemma 3's template takes (turns that alternate, ending with
    the user's; images in user turns, and in system and assistant turns on OpenAI's APIs). Half the cases hold
    only valid pictures, rightly sent, within the bounds; in the others about a third of the parts are wrong."""
    api = draw(st.sampled_from(apis))
    clean = draw(st.booleans())
    counts = [1, 1, 2, 3] if clean else [1, 1, 2, 4, 12]
    stream = draw(st.booleans())
    texts: list[tuple[str, str]] = []

    def right() -> bool:  # whether the next part is drawn right
        return clean or draw(st.integers(0, 2)) > 0

    if api == "ollama_generate":
        images = [draw(base64_image(right())) for _ in range(draw(st.sampled_from(counts)))]
        parts = [(f"images[{number}]", codes, size) for number, (_, codes, size) in enumerate(images)]
        body = {"model": "served", "prompt": _text(draw, "prompt", texts), "images": [text for text, _, _ in images],
                "stream": stream, "options": {"num_predict": draw(st.integers(1, 3))}}
        if not clean and draw(st.integers(0, 5)) == 0:  # images with a raw prompt: refused, naming images[0]
            body["raw"] = True
            bounds = {"invalid_prompt", "too_many_images", "image_too_large"}
            raw = tuple((where, codes | bounds) for where, codes, _ in parts)
            return VisionCase("/api/generate", body, _surrogates(texts) or raw)
        return VisionCase("/api/generate", body, _oracle(parts, texts))
    messages, parts, may_refuse = [], [], []
    for turn, role in enumerate(_roles(draw, api, clean)):
        where = f"{'input' if api.startswith('responses') else 'messages'}[{turn}]"
        if role == "assistant" and (api not in OPENAI_CONTENT or draw(st.booleans())):
            messages.append({"role": "assistant", "content": _text(draw, f"{where}.content", texts)})
            continue
        if api == "ollama_chat":
            images = [draw(base64_image(right())) for _ in range(draw(st.sampled_from(counts)))]
            parts += [(f"{where}.images[{number}]", codes, size) for number, (_, codes, size) in enumerate(images)]
            messages.append({"role": "user", "content": _text(draw, f"{where}.content", texts),
                             "images": [text for text, _, _ in images]})
            continue
        strategy, text_type = (responses_image_part, "input_text") if api.startswith("responses") else (
            (anthropic_image_block, "text") if api.startswith("anthropic") else (chat_image_part, "text"))
        content, found = _content(draw, strategy, right, where, text_type, counts, texts)
        parts += found
        if role != "user":  # images where Gemma 3's template may drop them, or fail
            may_refuse += [where for where, _, _ in found] + [where.split("[")[0]]
        messages.append({"role": role, "content": content})
    limit = draw(st.integers(1, 3))
    if api == "chat":
        path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": limit, "stream": stream}
    elif api == "apply_template":  # renders the markers: no image dropped is refused here
        path, body = "/apply-template", {"messages": messages}
        may_refuse = [where for where in may_refuse if "[" not in where]
    elif api == "anthropic_count":
        path, body = "/v1/messages/count_tokens", {"messages": messages}
    elif api.startswith("responses"):
        path, body = "/v1/responses", {"input": messages, "max_output_tokens": limit, "stream": stream}
        if api == "responses_socket":
            path, body = "ws:/v1/responses", {"type": "response.create", "input": messages, "max_output_tokens": limit,
                                              "store": True}
            if messages[0]["role"] == "user" and draw(st.integers(0, 2)) == 0:
                body["previous_response_id"] = "@last"  # the last stored response (not itself a follow-up)
    elif api == "anthropic":
        path, body = "/v1/messages", {"messages": messages, "max_tokens": limit, "stream": stream}
    else:
        path, body = "/api/chat", {"messages": messages, "stream": stream, "options": {"num_predict": limit}}
    return VisionCase(path, {"model": "served", **body}, _oracle(parts, texts), tuple(may_refuse))


class VisionFuzzer:
    """Sends `VisionCase`s through one of the fuzzers (its own checks of each answer), checking each refusal
    against the case's oracle. `drop_after` 0: a client that sends and never reads (its connection left open
    until `close_idle`); BURST: six clients send it at once."""

    def __init__(self, fuzzer, port: int) -> None:
        self.fuzzer = fuzzer
        self.port = port
        self.idle: list = []  # the connections of clients that never read
        self.socket = None  # a Responses websocket, kept open across its cases
        self.connections = ExitStack()  # every websocket opened
        self.socket_outcomes: Counter[str] = Counter()
        self.burst_outcomes: Counter[int] = Counter()  # the statuses of the bursts' answers
        self.last_response_id: str | None = None
        self.refused = 0
        self.never_read = 0

    def send(self, case: VisionCase, drop_after: int | None) -> None:
        path, body = case.encoded()
        if path.startswith("ws:"):
            return self.send_event(case, drop_after if drop_after != BURST else None)
        if drop_after == BURST:
            return self.send_burst(case, path, body)
        if drop_after == 0:
            self.never_read += 1
            client = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            client.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            self.idle.append(client)
            return
        seen = len(self.fuzzer.refusals)
        self.fuzzer.send(path, body, drop_after)
        for status, code, param in self.fuzzer.refusals[seen:]:
            self.refused += 1
            case.check_refusal(status, code, param)
        if len(self.fuzzer.refusals) == seen:
            assert case.refused_at is None, f"a request the server must refuse was answered: {case.refused_at}"

    def send_burst(self, case: VisionCase, path: str, body: bytes, clients: int = 6) -> None:
        """The request sent by `clients` clients at once (each on its connection, all sent before any is read),
        then each answer read whole: a 200, or the case's refusal."""
        connections = [http.client.HTTPConnection("127.0.0.1", self.port, timeout=60) for _ in range(clients)]
        try:
            for connection in connections:
                connection.request("POST", path, body, {"Content-Type": "application/json"})
            for connection in connections:
                response = connection.getresponse()
                data = response.read()
                self.burst_outcomes[response.status] += 1
                if response.status == 200:
                    assert case.refused_at is None, f"a request the server must refuse was answered: {case.refused_at}"
                    continue
                error = json.loads(data)
                inner = error if path.startswith("/api/") else error["error"]
                self.refused += 1
                case.check_refusal(response.status, inner.get("code"), inner.get("param"))
        finally:
            for connection in connections:
                connection.close()

    def send_event(self, case: VisionCase, drop_after: int | None) -> None:
        """A `response.create` event over the Responses websocket (`@last`: the last stored response's id, left out
        while there is none); its events read to the closing one or an error (or `drop_after` of them, then the
        connection closed)."""
        from websockets.sync.client import connect

        event, follow_up = dict(case.body), "previous_response_id" in case.body
        if follow_up:
            event["previous_response_id"] = self.last_response_id
            if self.last_response_id is None:
                del event["previous_response_id"]

        if self.socket is None:  # closed by close_idle at the latest
            self.socket = self.connections.enter_context(connect(f"ws://127.0.0.1:{self.port}/v1/responses",
                                                                 max_size=None))
        self.socket.send(json.dumps(event))
        if drop_after == 0:
            self.never_read += 1
            self.idle.append(self.socket)
            self.socket = None
            return
        for count in itertools.count(1):
            answer = json.loads(self.socket.recv(timeout=60))
            if answer["type"] == "error":
                self.refused += 1
                self.socket_outcomes["error"] += 1
                return case.check_refusal(answer["status"], answer["error"]["code"], answer["error"]["param"])
            assert answer["type"] != "response.failed", answer
            if answer["type"] in CLOSING_EVENTS:
                assert case.refused_at is None, f"a request the server must refuse was answered: {case.refused_at}"
                self.socket_outcomes["follow-up" if follow_up else "answer"] += 1
                if not follow_up:
                    self.last_response_id = answer["response"]["id"]
                return None
            if drop_after is not None and count >= drop_after:
                self.socket_outcomes["dropped"] += 1
                return self.reconnect()
        return None

    def reconnect(self) -> None:
        self.fuzzer.reconnect()
        if self.socket is not None:
            self.socket.close()
            self.socket = None

    def close_idle(self) -> None:
        """Close the connections of the clients that never read, and every websocket."""
        for client in self.idle:
            client.close()
        self.idle.clear()
        self.connections.close()
        self.socket = None


@contextmanager
def vision_fuzz_server(llm, **config):
    """A server for the tiny vision `llm` under VISION_BOUNDS, as the fuzzers run it (served as "served")."""
    from localserve.server.request.generation_request import RequestLimits
    from tests.helpers.server import running_server

    with running_server(llm, model_alias="served", default_max_output_tokens=3, send_timeout_s=5.0,
                        limits=RequestLimits(images=VISION_BOUNDS), **config) as server:
        yield server


def run_vision_fuzz(fuzzer, server, apis: tuple[str, ...], num_cases: int) -> VisionFuzzer:
    """`num_cases` of `vision_cases(apis)` sent through `fuzzer` (one of the HTTP fuzzers, with its own checks of
    each answer) to `server` (`vision_fuzz_server`), by clients that read to the end, vanish or never read; then
    the server whole (the engine idle, every block back, no exchange in flight) and its image embeddings cache
    within its bound. Returns the VisionFuzzer, for its counts."""
    from tests.helpers.fuzzing import assert_server_whole, send_generated_requests

    vision = VisionFuzzer(fuzzer, server.port)
    send_generated_requests(vision, vision_cases(apis).map(lambda case: (case,)), num_cases, drops=VISION_DROPS)
    vision.reconnect()
    vision.close_idle()
    assert vision.refused >= 5, vision.refused
    assert_server_whole(server)
    assert_embeddings_cache_bounded(server)
    return vision


def assert_embeddings_cache_bounded(server) -> None:
    """The image embeddings cache within its bound, after encoding images and finding some again."""
    cache = server.server.models.serving_now().engine.engine.runner.image_embeds
    assert cache.num_encoded > 0 and cache.num_hits > 0 and cache.num_bytes <= cache.max_bytes, \
        (cache.num_encoded, cache.num_hits, cache.num_bytes)


# the clients: read to the end (None), vanish after 1-3 reads, never read (0), or six at once (BURST)
BURST = -1
VISION_DROPS = st.sampled_from([None, None, None, None, 1, 2, 3, 0, BURST])
