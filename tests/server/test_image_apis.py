"""Images over every API to the (text-only) tiny model, sent by the official clients: the `openai` SDK (chat
and Responses), the `anthropic` SDK and the `ollama` client send a real image and get the clear 400 ("model
'served' does not take images", naming the first image part) through their own error types; a broken image
gets its own 400 naming its part; each bound at its limit reaches the model's refusal and one past it is
refused by the bound; the capabilities say no vision (/v1/models, /api/show, /props); the server keeps
serving text all along."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random

import anthropic
import ollama
import openai
import pytest
from PIL import Image

from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS
from localserve.server.registry.served_model import ServedModel
from localserve.server.request.generation_request import GenerationRequest, PlacedImage, RequestLimits
from localserve.server.request.images import ImageBounds, decode_image
from localserve.server.request.validation import ProtocolError
from tests.helpers.raw_client import RawClient
from tests.helpers.server import post_json as send_json
from tests.helpers.server import post_ok, running_server
from tests.helpers.webui_page import get_json as get_ok

BOUNDS = ImageBounds(max_bytes=4096, max_total_bytes=6000, max_images=2, max_pixels=32 * 32)
NO_IMAGES = "model 'served' does not take images"


def png(size: tuple[int, int] = (8, 8), noise: bool = False) -> bytes:
    image = Image.new("RGB", size, (10, 120, 240))
    if noise:  # incompressible: its file grows with its pixels
        image = Image.frombytes("RGB", size, random.Random(0).randbytes(size[0] * size[1] * 3))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


PNG = png()
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, model_alias="served", default_max_output_tokens=2,
                        limits=RequestLimits(images=BOUNDS)) as server:
        yield server


@pytest.fixture(scope="module")
def openai_client(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0) as client:
        yield client


def still_serves(server) -> None:
    answer = post_ok(server.port, "/v1/chat/completions", {"model": "served", "messages": [
        {"role": "user", "content": "hello"}], "max_tokens": 2})
    assert answer["choices"][0]["finish_reason"] == "length"


def test_openai_chat_and_responses_get_the_models_refusal(server, openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="served", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": URL}}]}])
    assert caught.value.code == "model_takes_no_images" and caught.value.param == "messages[0].content[1]"
    assert NO_IMAGES in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(model="served", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": URL, "detail": "auto"}, {"type": "input_text", "text": "what?"}]}])
    assert caught.value.code == "model_takes_no_images" and caught.value.param == "input[0].content[0]"
    with pytest.raises(openai.BadRequestError) as caught:  # an image that needs fetching: refused before the model
        openai_client.chat.completions.create(model="served", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert caught.value.code == "invalid_image_url" and "does not fetch" in caught.value.message
    still_serves(server)


def test_anthropic_sdk_gets_the_models_refusal(server):
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what?"}, {"type": "image", "source": source}]}]
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0) as sdk:
        with pytest.raises(anthropic.BadRequestError) as caught:
            sdk.messages.create(model="served", max_tokens=2, messages=messages)
        assert NO_IMAGES in caught.value.message and "messages[0].content[1]" in caught.value.message
        with pytest.raises(anthropic.BadRequestError) as caught:
            sdk.messages.count_tokens(model="served", messages=messages)
        assert NO_IMAGES in caught.value.message
        wrong = [{"role": "user", "content": [{"type": "image", "source": {**source, "media_type": "image/jpeg"}}]}]
        with pytest.raises(anthropic.BadRequestError) as caught:
            sdk.messages.create(model="served", max_tokens=2, messages=wrong)
        assert "not the declared" in caught.value.message
    still_serves(server)


def test_ollama_client_gets_the_models_refusal(server):
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="served", messages=[{"role": "user", "content": "what?", "images": [PNG]}])
    assert caught.value.status_code == 400 and NO_IMAGES in caught.value.error
    assert "messages[0].images[0]" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="served", prompt="what?", images=[PNG])
    assert caught.value.status_code == 400 and NO_IMAGES in caught.value.error and "images[0]" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="served", prompt="what?", images=[b"not an image at all"])
    assert caught.value.status_code == 400 and "is not an image this server reads" in caught.value.error
    assert "vision" not in client.show("served").capabilities
    still_serves(server)


def test_capabilities_say_no_vision(server):
    [model] = get_ok(server.port, "/v1/models")["data"]
    assert model["takes_images"] is False
    assert get_ok(server.port, "/props")["modalities"] == {"vision": False, "audio": False}
    assert "vision" not in post_ok(server.port, "/api/show", {"model": "served"})["capabilities"]


def chat_with(*urls: str) -> dict:
    return {"model": "served", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"}, *({"type": "image_url", "image_url": {"url": url}} for url in urls)]}]}


def url_of(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def side(pixels: int) -> tuple[int, int]:
    return (pixels // 16, 16)


@pytest.mark.parametrize("name, at_limit, past_limit, code", [
    # each bound over the wire: at its limit the parse passes and the model refuses; one past, the bound refuses
    ("images", chat_with(URL, URL), chat_with(URL, URL, URL), "too_many_images"),
    ("pixels", chat_with(url_of(png(side(32 * 32)))), chat_with(url_of(png((32 * 32 + 1, 1)))), "image_too_large"),
])
def test_each_bound_at_its_limit_and_one_past_over_the_wire(server, name, at_limit, past_limit, code):
    status, error = send_json(server.port, "/v1/chat/completions", at_limit)
    assert (status, error["error"]["code"]) == (400, "model_takes_no_images"), error
    status, error = send_json(server.port, "/v1/chat/completions", past_limit)
    assert (status, error["error"]["code"]) == (400, code), error
    still_serves(server)


def test_the_bytes_bounds_over_the_wire(server):
    noisy = png((32, 32), noise=True)
    assert 3000 < len(noisy) <= BOUNDS.max_bytes, len(noisy)
    padded = noisy + b"\0" * (BOUNDS.max_bytes - len(noisy))  # PNG readers stop at IEND: trailing bytes are slack
    status, error = send_json(server.port, "/v1/chat/completions", chat_with(url_of(padded)))
    assert (status, error["error"]["code"]) == (400, "model_takes_no_images"), error
    status, error = send_json(server.port, "/v1/chat/completions", chat_with(url_of(padded + b"\0")))
    assert (status, error["error"]["code"], error["error"]["param"]) == (
        400, "image_too_large", "messages[0].content[1]"), error
    status, error = send_json(server.port, "/v1/chat/completions", chat_with(url_of(noisy), url_of(noisy)))
    assert (status, error["error"]["code"], error["error"]["param"]) == (
        400, "image_too_large", "messages[0].content[2]"), error  # together beyond max_total_bytes
    still_serves(server)


def test_a_model_that_takes_images_says_so_and_passes_the_check():
    request = GenerationRequest(input_messages=[{"role": "user", "content": "x"}], images=(
        PlacedImage(0, 0, decode_image(PNG, "messages[0].images[0]", ImageBounds())),))
    seeing = ServedModel("eyes", 64, LLAMA_CPP_DEFAULTS, takes_images=True)
    seeing.check_images(request)
    assert "vision" in seeing.capabilities
    blind = ServedModel("blind", 64, LLAMA_CPP_DEFAULTS)
    with pytest.raises(ProtocolError, match="model 'blind' does not take images") as caught:
        blind.check_images(request)
    assert caught.value.param == "messages[0].images[0]"
    blind.check_images(GenerationRequest(input_messages=[{"role": "user", "content": "x"}]))


def test_a_large_body_is_parsed_off_the_event_loop_with_the_same_answers(server):
    large = chat_with(URL)
    large["messages"][0]["content"][0]["text"] = "see " * 80_000  # 320 KB: over INLINE_PARSE_BYTES
    status, error = send_json(server.port, "/v1/chat/completions", large)
    assert (status, error["error"]["code"], error["error"]["param"]) == (
        400, "model_takes_no_images", "messages[0].content[1]"), error
    large["messages"][0]["content"][1]["image_url"]["url"] = "https://example.com/a.png"
    status, error = send_json(server.port, "/v1/chat/completions", large)
    assert (status, error["error"]["code"]) == (400, "invalid_image_url"), error
    still_serves(server)


def test_the_image_flags_set_the_bounds():
    import argparse

    from localserve.cli import add_server_args, server_config

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    defaults = server_config(parser.parse_args([]))
    assert defaults.limits.images == ImageBounds()
    assert defaults.max_body_bytes == defaults.max_message_bytes + ImageBounds().max_body_bytes
    config = server_config(parser.parse_args(["--max-image-bytes", "100", "--max-request-image-bytes", "300",
                                              "--max-images", "3", "--max-image-pixels", "64"]))
    assert config.limits.images == ImageBounds(max_bytes=100, max_total_bytes=300, max_images=3, max_pixels=64)
    with pytest.raises(SystemExit, match="--max-images must be >= 1"):
        server_config(parser.parse_args(["--max-images", "0"]))


def test_the_websocket_mode_refuses_images_in_order_small_and_large(server):
    async def talk() -> list[dict]:
        client = await RawClient.open(server.port)
        small = {"type": "response.create", "stream_id": "a", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": URL}]}]}
        large = {**small, "stream_id": "b", "instructions": "x" * 300_000}  # parsed on a worker thread
        broken = {**small, "stream_id": "c", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://127.0.0.1/a.png"}]}]}
        for event in (large, small, broken):
            await client.send_text(json.dumps(event))
        events = [await client.recv(30) for _ in range(3)]
        client.abort()
        return events

    events = asyncio.run(talk())
    # Each stream gets its own refusal: a broken part when the frame is read, the model's when its lane builds
    # the prompt, so streams' errors may interleave either way (they are parsed in order).
    assert sorted((event["stream_id"], event["error"]["code"]) for event in events) == [
        ("a", "model_takes_no_images"), ("b", "model_takes_no_images"), ("c", "invalid_image_url")], events
    still_serves(server)
