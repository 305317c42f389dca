"""What the HTTP fuzzers share: running their generated cases, the checks that the server came out whole, and
image parts as each API spells them, valid and broken (real files made with Pillow, cut ones, other formats,
decompression bombs, bad base64, URLs to fetch)."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.helpers.server import wait_until_idle

DROPS = st.none() | st.integers(1, 3)


def send_generated_requests(fuzzer, requests: st.SearchStrategy, num_cases: int,
                            drops: st.SearchStrategy = DROPS) -> None:
    """`num_cases` requests drawn from `requests`, each sent by `fuzzer.send(*request, drop_after)` (the
    client vanishing after `drops` reads: 1-3, or never), then the fuzzer's connection closed."""

    @settings(max_examples=num_cases, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(request=requests, drop_after=drops)
    def one_case(request, drop_after):
        fuzzer.send(*request, drop_after)

    one_case()
    fuzzer.reconnect()


def assert_server_whole(server, timeout_s: float = 10.0) -> None:
    """The served model's engine idle with every block back (its integrity checked), its thread alive, and no
    HTTP exchange left in flight (within `timeout_s`: a client that has just closed its connection is noticed
    by the server's next read or write)."""
    engine = server.server.models.serving_now().engine
    wait_until_idle(engine)
    assert engine._thread.is_alive()
    deadline = time.monotonic() + timeout_s
    while server.server.http_api.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.server.http_api.in_flight


# ---------------------------------------------------------------------------------- image parts
def _image_file(kind: str, size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (40, 90, 200)).save(out, format=kind)
    return out.getvalue()


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels over a few bytes of data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) + chunk(
        b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def _image_strategies() -> tuple[st.SearchStrategy, ...]:
    valid = [_image_file(kind, size) for kind, size in (("PNG", (4, 3)), ("JPEG", (8, 8)), ("WEBP", (2, 5)),
                                                          ("GIF", (3, 3)))]
    broken = [valid[0][:30], valid[1][:-20], b"GIF89a", b"\x89PNG\r\n\x1a\n", _image_file("BMP", (2, 2)),
              _bomb_png(100_000, 100_000), _bomb_png(0, 7)]
    good_texts = st.sampled_from([base64.b64encode(data).decode() for data in valid])
    texts = good_texts | (st.sampled_from(broken) | st.binary(max_size=24)).map(
        lambda data: base64.b64encode(data).decode()) | st.sampled_from(
        ["", "%%%", "aGk=", "AAAA\n", "data:image/png;base64,AAAA"])
    mimes = st.sampled_from(["image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp", "text/plain", ""])
    good_urls = good_texts.map(lambda text: f"data:image/png;base64,{text}")
    urls = good_urls | st.builds(lambda mime, text: f"data:{mime};base64,{text}", mimes, texts) | st.sampled_from(
        ["https://example.com/a.png", "http://127.0.0.1/x.png", "file:///etc/passwd", "data:image/png,raw", ""])
    return good_texts, texts, mimes, good_urls, urls


GOOD_BASE64, IMAGE_BASE64, IMAGE_MEDIA_TYPES, GOOD_URLS, IMAGE_URLS = _image_strategies()
# an image part as each API spells it, valid (often: the model's own refusal must come) or broken; tiny files,
# which fit the fuzzers' small bodies
chat_image_parts = st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
    {"url": GOOD_URLS})}) | st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": IMAGE_URLS}, optional={"detail": st.sampled_from(["auto", "low", "high", "huge"])}) | st.just("x")})
responses_image_parts = st.fixed_dictionaries({"type": st.just("input_image"), "image_url": GOOD_URLS}) | \
    st.fixed_dictionaries({"type": st.just("input_image")}, optional={
        "image_url": IMAGE_URLS, "detail": st.sampled_from(["auto", "high", 5]), "file_id": st.just("file-1")})
PNG_BASE64 = base64.b64encode(_image_file("PNG", (3, 2))).decode()
anthropic_image_blocks = st.fixed_dictionaries({"type": st.just("image"), "source": st.just(
    {"type": "base64", "media_type": "image/png", "data": PNG_BASE64}) | st.fixed_dictionaries(
        {"type": st.sampled_from(["base64", "base64", "url", "file"]), "media_type": IMAGE_MEDIA_TYPES,
         "data": IMAGE_BASE64}) | st.just({"type": "url", "url": "https://example.com/a.png"})})
ollama_images = st.lists(GOOD_BASE64, min_size=1, max_size=2) | st.lists(IMAGE_BASE64, min_size=1, max_size=3)
