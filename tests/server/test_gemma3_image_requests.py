"""Requests with images to a tiny Gemma 3 (four tokens per image), on their way to the engine: what reaches it for
conversations with images at random places (generated: each span where the prompt holds an image's tokens, in
order, with that image's hash and the bidirectional flag; nothing left behind); the prompt's text as
/apply-template shows it (the chat template's marker, as transformers renders it); Anthropic's count_tokens; and
the clear 400s: a chat template that places another number of images than sent, images with a raw prompt."""

from __future__ import annotations

import base64

import anthropic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localserve.engine.engine_thread import EngineThread
from localserve.engine.multimodal import MultiModalInputs
from localserve.server.request.images import ImageBounds, decode_image
from tests.helpers.pictures import picture
from tests.helpers.server import make_llm, post_json, post_ok, running_server, wait_until_idle
from tests.helpers.vision_models import (
    BOI_ID,
    EOI_ID,
    IMAGE_ID,
    data_url,
    png_file,
    reference_processor,
    write_tiny_gemma3_vision,
)

MM_TOKENS = 4



PICTURES = [png_file(picture(20 + 7 * seed, 16 + 3 * seed, seed=seed)) for seed in range(3)]
HASHES = [decode_image(data, "x", ImageBounds()).sha256 for data in PICTURES]


def url(index: int) -> str:
    return data_url(PICTURES[index])


class SeenEngineThread(EngineThread):
    """Runs each request as usual, keeping its prompt and images (the latest server's)."""

    latest: SeenEngineThread | None = None

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.seen: list[tuple[list[int], MultiModalInputs | None]] = []
        SeenEngineThread.latest = self

    def submit(self, prompt_token_ids, params, on_output, request_id=None, multimodal=None):
        self.seen.append((list(prompt_token_ids), multimodal))
        return super().submit(prompt_token_ids, params, on_output, request_id=request_id, multimodal=multimodal)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3"), seed=7, mm_tokens_per_image=MM_TOKENS)


@pytest.fixture(scope="module")
def served(folder):
    with running_server(make_llm(folder, num_kv_blocks=128), engine_thread_type=SeenEngineThread,
                        model_alias="served", default_max_output_tokens=2) as server:
        yield server, SeenEngineThread.latest


def image_runs(ids: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each run of image soft tokens in `ids`."""
    runs: list[tuple[int, int]] = []
    for index, token in enumerate(ids):
        if token != IMAGE_ID:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


WORDS = st.sampled_from(["cat", "the sky", "two dogs", "what?", "a  b", "\n", "<start_of_image>", "ok"])
PART = st.one_of(WORDS.map(lambda text: ("text", text)), st.integers(0, len(PICTURES) - 1).map(lambda i: ("image", i)))


@st.composite
def conversations(draw):
    """Alternating turns (Gemma 3's template demands it), ending with the user's: (role, parts), a user's parts
    ("text", text) or ("image", picture index), at least one image in all, at most 6."""
    turns = draw(st.integers(0, 2)) * 2 + 1
    messages, num_images = [], 0
    for turn in range(turns):
        if turn % 2:
            messages.append(("assistant", [("text", draw(WORDS))]))
            continue
        parts = [(kind, value) for kind, value in draw(st.lists(PART, min_size=1, max_size=4))
                 if kind == "text" or (num_images := num_images + 1) <= 6]
        messages.append(("user", parts or [("text", "hi")]))
    if not any(kind == "image" for _, parts in messages for kind, _ in parts):
        messages[-1][1].append(("image", 0))
    return messages


def on_the_wire(api: str, messages) -> tuple[str, dict, list[int]]:
    """The conversation as `api` sends it: its path, its body and the images in the order they stand (Ollama's
    `images` stand before their message's text)."""
    encoded = [base64.b64encode(data).decode() for data in PICTURES]
    order = []
    if api == "ollama":
        wire = []
        for role, parts in messages:
            images = [value for kind, value in parts if kind == "image"]
            order += images
            wire.append({"role": role, "content": "".join(value for kind, value in parts if kind == "text"),
                         **({"images": [encoded[index] for index in images]} if images else {})})
        return "/api/chat", {"model": "served", "messages": wire, "stream": False,
                             "options": {"num_predict": 1}}, order
    order = [value for _, parts in messages for kind, value in parts if kind == "image"]
    if api == "anthropic":
        wire = [{"role": role, "content": [
            {"type": "text", "text": value} if kind == "text" else
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded[value]}}
            for kind, value in parts]} for role, parts in messages]
        return "/v1/messages", {"model": "served", "messages": wire, "max_tokens": 1}, order
    wire = [{"role": role, "content": [{"type": "text", "text": value} if kind == "text" else
                                       {"type": "image_url", "image_url": {"url": url(value)}}
                                       for kind, value in parts]} for role, parts in messages]
    return "/v1/chat/completions", {"model": "served", "messages": wire, "max_tokens": 1}, order


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations(), api=st.sampled_from(["openai", "anthropic", "ollama"]))
def test_images_at_random_places_reach_the_engine_as_their_spans(served, messages, api):
    server, engine_thread = served
    path, body, images = on_the_wire(api, messages)
    before = len(engine_thread.seen)
    status, answer = post_json(server.port, path, body)
    assert status == 200, answer
    [(ids, multimodal)] = engine_thread.seen[before:]
    assert multimodal is not None
    spans = [(span.offset, span.length) for span in multimodal.spans]
    assert spans == image_runs(ids) and all(length == MM_TOKENS for _, length in spans)
    assert [span.content_hash for span in multimodal.spans] == [HASHES[index] for index in images]
    assert all(span.bidirectional for span in multimodal.spans)
    for offset, length in spans:  # Gemma3Processor's text around each image
        assert ids[offset - 3:offset] == ids[offset + length + 1:offset + length + 3] + [BOI_ID]
        assert ids[offset + length] == EOI_ID
    wait_until_idle(engine_thread)


def test_apply_template_shows_the_templates_marker(served, folder):
    from tests.helpers.webui_page import get_json

    server, _ = served
    assert get_json(server.port, "/props")["modalities"]["vision"] is True
    content = [{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": url(1)}},
               {"type": "text", "text": "what is it?"}]
    shown = post_ok(server.port, "/apply-template", {"messages": [{"role": "user", "content": content}]})["prompt"]
    expected = reference_processor(folder).apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "look:"}, {"type": "image"},
                                      {"type": "text", "text": "what is it?"}]}], tokenize=False,
        add_generation_prompt=True)
    assert shown == expected and shown.count("<start_of_image>") == 1 and "<image_soft_token>" not in shown


def test_anthropic_count_tokens_counts_the_images_tokens(served):
    server, engine_thread = served
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(PICTURES[2]).decode()}},
               {"type": "text", "text": "and this one?"}]
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="-", max_retries=0) as client:
        counted = client.messages.count_tokens(model="served", messages=[{"role": "user", "content": content}])
        message = client.messages.create(model="served", max_tokens=1, messages=[{"role": "user",
                                                                                  "content": content}])
    usage = message.usage  # Anthropic's input_tokens leave out those read from the cache
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens == len(engine_thread.seen[-1][0])


def test_ollama_generate_places_images_through_the_template_and_refuses_them_raw(served):
    server, engine_thread = served
    image = base64.b64encode(PICTURES[0]).decode()
    answer = post_ok(server.port, "/api/generate", {"model": "served", "prompt": "what is it?", "images": [image],
                                                    "stream": False, "options": {"num_predict": 1}})
    assert answer["done"] and [span.offset for span in engine_thread.seen[-1][1].spans] == \
        [offset for offset, _ in image_runs(engine_thread.seen[-1][0])]
    before = len(engine_thread.seen)
    status, body = post_json(server.port, "/api/generate", {"model": "served", "prompt": "<start_of_image>",
                                                            "raw": True, "images": [image], "stream": False})
    assert status == 400 and "images[0]" in body["error"] and "raw" in body["error"]
    assert len(engine_thread.seen) == before
    wait_until_idle(engine_thread)


IMAGELESS_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
                      "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                      "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
                      "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
                      "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_a_template_that_places_another_number_of_images_is_a_400_naming_the_image(folder):
    llm = make_llm(folder, num_kv_blocks=32)
    llm.tokenizer.chat_template = IMAGELESS_TEMPLATE  # drops image parts
    with running_server(llm, model_alias="served") as server:
        status, body = post_json(server.port, "/v1/chat/completions", {"model": "served", "max_tokens": 1,
                                                                       "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url(0)}}]}]})
        assert status == 400, body
        error = body["error"]
        assert error["code"] == "invalid_prompt" and error["param"] == "messages[0].content[1]"
        assert "placed 0 image markers" in error["message"] and "1 image" in error["message"]
        text = post_ok(server.port, "/v1/chat/completions", {"model": "served", "max_tokens": 1,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert text["choices"][0]["finish_reason"] in ("length", "stop")


def test_served_from_a_models_folder_it_takes_images_and_a_text_model_refuses_its_conversation(folder, tmp_path):
    """The server's own loader (model_loader.py's EngineLoader): the Gemma 3 folder's encoder reaches the requests
    (capabilities say vision; an image is answered); a follow-up naming its response on a text model is refused:
    the stored conversation keeps the image."""
    import shutil

    from localserve.server.registry.registry import ModelPolicy
    from tests.helpers.server import running_models_server, write_tiny_chat_model

    shutil.copytree(folder, tmp_path / "gemma")
    write_tiny_chat_model(tmp_path / "text")
    with running_models_server(tmp_path, policy=ModelPolicy(max_loaded_models=2)) as server:
        shown = post_ok(server.port, "/api/show", {"model": "gemma"})
        assert "vision" in shown["capabilities"]
        assert "vision" not in post_ok(server.port, "/api/show", {"model": "text"})["capabilities"]
        image = {"type": "input_image", "image_url": url(0), "detail": "auto"}
        first = post_ok(server.port, "/v1/responses", {"model": "gemma", "max_output_tokens": 1, "input": [
            {"role": "user", "content": [image, {"type": "input_text", "text": "what is it?"}]}]})
        assert first["status"] in ("completed", "incomplete")  # cut at its one token
        status, body = post_json(server.port, "/v1/responses", {"model": "text", "max_output_tokens": 1,
                                                                "previous_response_id": first["id"],
                                                                "input": "and now?"})
        assert status == 400 and body["error"]["code"] == "model_takes_no_images", body
        assert "input[0].content[0]" in body["error"]["message"]


def test_an_image_beside_tools_and_a_tool_turn(served):
    """The chat format's conversion of tool turns (results merged, a tools prompt added as the system message)
    comes after the images are placed: the image stays in its message."""
    server, engine_thread = served
    tool = {"type": "function", "function": {"name": "look", "description": "look closer",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(2)}},
                                             {"type": "text", "text": "what is it?"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a cat"}]
    answer = post_ok(server.port, "/v1/chat/completions", {"model": "served", "messages": messages,
                                                           "tools": [tool], "max_tokens": 1})
    assert answer["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")
    ids, multimodal = engine_thread.seen[-1]
    assert [(span.offset, span.length) for span in multimodal.spans] == image_runs(ids)
    assert [span.content_hash for span in multimodal.spans] == [HASHES[2]]
    wait_until_idle(engine_thread)
