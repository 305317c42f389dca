"""What the server remembers of pictures seen (server/request/image_cache.py): the LRU against a model dict (a
generated test) and at its byte bound and one past it; a file sent again is not decoded again (Pillow's opens
counted) and gives the same ImageInput, its bounds checked as before; the same pixels in another file hash alike
(decoded once more, then both held); a picture is prepared once per model (server/generation/image_prompt.py's
`prepare_images`), two models' prepared images apart."""

from __future__ import annotations

import asyncio
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from localserve.engine.image_prompt import PreparedImage
from localserve.server.generation.image_prompt import prepare_images, prepared_bytes
from localserve.server.request import images as images_module
from localserve.server.request.image_cache import DECODED_FILES, BytesLRU
from localserve.server.request.images import ImageBounds, PlacedImage, decode_image
from localserve.server.request.validation import ProtocolError


def png(size=(6, 4), color=(10, 200, 30), kind="PNG", **save) -> bytes:
    image = Image.new("RGB", size, color)
    image.putpixel((0, 0), (0, 0, 0))
    out = io.BytesIO()
    image.save(out, format=kind, **save)
    return out.getvalue()


@pytest.fixture
def opens(monkeypatch) -> list[int]:
    """Counts the images.py module's Pillow opens (each decode opens the file once)."""
    calls = []
    real = images_module.Image.open

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(images_module.Image, "open", counting)
    return calls


# ---------------------------------------------------------------- the LRU
def test_the_byte_bound_at_the_limit_and_one_past():
    cache = BytesLRU(100)
    cache.put("a", 1, 40)
    cache.put("b", 2, 60)  # 100: at the bound, both kept
    assert cache.keys() == ["a", "b"] and cache.num_bytes == 100
    cache.put("c", 3, 1)  # one past: the least recently used goes
    assert cache.keys() == ["b", "c"] and cache.num_bytes == 61
    assert cache.get("b") == 2 and cache.keys() == ["c", "b"]  # a get makes it the most recent
    cache.put("d", 4, 100)  # an entry of the whole bound: alone
    assert cache.keys() == ["d"] and cache.num_bytes == 100
    cache.put("e", 5, 101)  # larger than the bound: not kept, the others stay
    assert cache.keys() == ["d"] and cache.get("e") is None
    cache.put("d", 6, 101)  # replacing a key with too large a value drops it
    assert len(cache) == 0 and cache.num_bytes == 0
    with pytest.raises(ValueError, match="size"):
        cache.put("f", 1, -1)
    with pytest.raises(ValueError, match="max_bytes"):
        BytesLRU(-1)


@settings(max_examples=60, deadline=None)
@given(bound=st.integers(0, 50), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 30)),
                                               max_size=40))
def test_the_lru_behaves_as_a_model_dict(bound, ops):
    cache, model = BytesLRU(bound), OrderedDict()  # model: key -> (value, size), least recent first
    for step, (is_put, key, size) in enumerate(ops):
        if is_put:
            cache.put(key, step, size)
            model.pop(key, None)
            if size <= bound:
                model[key] = (step, size)
                while sum(held for _, held in model.values()) > bound:
                    model.popitem(last=False)
        else:
            expected = model.get(key)
            if expected is not None:
                model.move_to_end(key)
            assert cache.get(key) == (expected[0] if expected else None)
        assert cache.keys() == list(model)
        assert cache.num_bytes == sum(held for _, held in model.values()) <= bound


def test_threads_together_keep_the_books():
    """Puts and gets from several threads at once (request parsing and preparing run on worker threads): the
    bytes held stay within the bound and equal to what the entries were put with."""
    cache, bound = BytesLRU(1000), 1000

    def work(seed: int) -> None:
        for step in range(2000):
            key = (seed * 7 + step) % 23
            if step % 3:
                cache.put(key, (key, step), 10 + key * 5)
            else:
                value = cache.get(key)
                assert value is None or value[0] == key
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.num_bytes == sum(10 + key * 5 for key in cache.keys()) <= bound


# ---------------------------------------------------------------- decoded files
def test_a_file_sent_again_is_decoded_once_and_gives_the_same_input(opens):
    cache, bounds, data = BytesLRU(1 << 20), ImageBounds(), png()
    first = decode_image(data, "messages[0].content[1]", bounds, cache=cache)
    again = decode_image(bytes(data), "input[2].content[0]", bounds, "image/png", cache=cache)
    assert len(opens) == 1
    assert again == replace(first, where="input[2].content[0]")
    assert again == decode_image(data, "input[2].content[0]", bounds, "image/png", cache=None)  # as uncached
    assert len(opens) == 2


def test_a_cached_file_is_held_to_the_bounds_as_before(opens):
    cache, data = BytesLRU(1 << 20), png(size=(6, 4))
    decode_image(data, "p", ImageBounds(), cache=cache)
    for bounds, media_type in ((ImageBounds(max_bytes=len(data) - 1), None), (ImageBounds(max_pixels=23), None),
                               (ImageBounds(), "image/jpeg")):
        with pytest.raises(ProtocolError) as cached:
            decode_image(data, "p", bounds, media_type, cache=cache)
        with pytest.raises(ProtocolError) as uncached:
            decode_image(data, "p", bounds, media_type, cache=None)
        assert (cached.value.code, cached.value.message) == (uncached.value.code, uncached.value.message)
    at_limit = decode_image(data, "p", ImageBounds(max_bytes=len(data), max_pixels=24), cache=cache)
    assert (at_limit.width, at_limit.height) == (6, 4)
    assert len(opens) == 1 + 2  # the first decode, the two uncached refusals after an open (not the bytes bound)


def test_the_same_pixels_in_another_file_hash_alike(opens):
    cache, bounds = BytesLRU(1 << 20), ImageBounds()
    png_data, webp_data = png(), png(kind="WEBP", lossless=True)
    first = decode_image(png_data, "a", bounds, cache=cache)
    second = decode_image(webp_data, "b", bounds, cache=cache)
    assert len(opens) == 2 and first.sha256 == second.sha256 and first.format != second.format
    decode_image(png_data, "a", bounds, cache=cache)
    decode_image(webp_data, "b", bounds, cache=cache)
    assert len(opens) == 2 and len(cache) == 2


def test_the_process_cache_serves_decode_image_by_default(opens):
    data = png(size=(7, 3), color=(1, 2, 3))
    first = decode_image(data, "a", ImageBounds())
    assert decode_image(data, "a", ImageBounds()) == first and len(opens) == 1
    assert len(DECODED_FILES) >= 1


# ---------------------------------------------------------------- prepared images
@dataclass
class CountingEncoder:
    """An encoder whose prepare counts its calls and gives the picture's pixels (bytes) as inputs."""

    name: str
    marker: str = "<img>"
    hidden_size: int = 4
    calls: int = 0

    def prepare(self, picture: Image.Image) -> PreparedImage:
        self.calls += 1
        pixels = picture.convert("RGB").tobytes()
        return PreparedImage(text=f"[{self.name}]", span_ids=(1, 2), inputs=(self.name, pixels))

    def encode(self, prepared):
        raise AssertionError("not here")


def fields(prepared: PreparedImage) -> tuple:
    return prepared.text, prepared.span_ids, prepared.inputs, prepared.bidirectional, prepared.rope_positions


def placed(data: bytes) -> PlacedImage:
    return PlacedImage(0, 0, decode_image(data, "messages[0].content[0]", ImageBounds(), cache=None))


def test_a_picture_is_prepared_once_per_model_and_models_do_not_share():
    gemma, qwen = CountingEncoder("gemma"), CountingEncoder("qwen")
    gemma_cache, qwen_cache = BytesLRU(1 << 20), BytesLRU(1 << 20)
    picture = placed(png())
    reencoded = placed(png(kind="WEBP", lossless=True))  # the same pixels
    first = asyncio.run(prepare_images(gemma, [picture], gemma_cache)).prompt.prepared
    again = asyncio.run(prepare_images(gemma, [picture, reencoded], gemma_cache)).prompt.prepared
    assert gemma.calls == 1 and again[0] is again[1] is first[0]
    other = asyncio.run(prepare_images(qwen, [picture], qwen_cache)).prompt.prepared
    assert qwen.calls == 1 and other[0].text == "[qwen]" and first[0].text == "[gemma]"
    uncached = asyncio.run(prepare_images(gemma, [picture], None)).prompt.prepared
    assert gemma.calls == 2 and fields(uncached[0]) == fields(first[0])  # the same as the cache gives
    assert gemma_cache.num_bytes == prepared_bytes(first[0])


def test_a_prepared_image_is_counted_by_its_tensors():
    import torch

    prepared = PreparedImage(text="ab", span_ids=(1, 2, 3), inputs={"pixels": torch.zeros(3, 4, 5),
                                                                     "grid": [torch.zeros(2, dtype=torch.int64)]},
                             rope_positions=torch.zeros(3, 3, dtype=torch.int64))
    assert prepared_bytes(prepared) == 240 + 16 + 72 + 8 + 24 + 256
