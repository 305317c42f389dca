"""The web page with a model that sees, end to end in Chromium: a server of a tiny random Gemma 3 (SigLIP tower
and projector, tests/helpers/vision_models.py) shows the attach button by itself (its /v1/models entry takes
images); the page attaches a PNG drawn with Pillow, shows it, sends it and gets a reply: the same greedy text
the `openai` SDK gets for the same request; the monitor frames the page received while it ran carry the
request's image span (one image of the model's tokens per image). With a folder of a text model and a model that
sees, the attach button follows the model picked, and shows for the model that sees once it is loaded."""

from __future__ import annotations

import json

import pytest

from tests.helpers.browser import slowed
from tests.helpers.pictures import picture
from tests.helpers.server import make_llm, openai_client, running_models_server, running_server
from tests.helpers.vision_models import data_url, png_file, write_tiny_gemma3_vision
from tests.helpers.webui_page import DROP_OR_PASTE, open_page, send, set_settings, wait_reply_done

STEP_DELAY_S = 0.05  # a reply spans a few monitor frames
NUM_TOKENS = 8
MM_TOKENS = 4  # tokens per image
QUESTION = "what is in this picture?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3"), seed=3, mm_tokens_per_image=MM_TOKENS)
    llm = make_llm(folder, num_kv_blocks=64)
    assert llm.vision is not None
    with running_server(slowed(llm, STEP_DELAY_S), monitor_interval_s=0.05) as background:
        yield background


def test_the_page_attaches_an_image_shows_it_and_gets_the_sdks_reply(page, server):
    png = png_file(picture(40, 30, seed=1))
    url = data_url(png)
    frames: list[dict] = []
    page.on("websocket", lambda socket: socket.on("framereceived", lambda payload: frames.append(json.loads(payload))))
    bodies: list[dict] = []
    page.on("request", lambda request: bodies.append(request.post_data_json)
            if request.url.endswith("/v1/chat/completions") else None)
    open_page(page, server.port)
    page.wait_for_selector("#attach:not([hidden])")  # the model takes images: no help from the test
    set_settings(page, {"temperature": "0", "max_tokens": str(NUM_TOKENS)})
    page.set_input_files("#attach-input", files=[{"name": "picture.png", "mimeType": "image/png", "buffer": png}])
    page.wait_for_selector("#attachments img")
    assert page.get_attribute("#attachments img", "src") == url  # shown before it is sent
    send(page, QUESTION)
    wait_reply_done(page)
    assert page.get_attribute(".message.user .images img", "src") == url  # and in the conversation
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]
    assert bodies[0]["messages"] == [{"role": "user", "content": content}]
    stored = json.loads(page.evaluate("localStorage.getItem('localserve.conversations')"))
    (conversation,) = stored
    reply = conversation["messages"][-1]
    assert reply["role"] == "assistant" and reply["error"] is None
    with openai_client(server.port) as client:
        expected = client.chat.completions.create(model=bodies[0]["model"], max_tokens=NUM_TOKENS, temperature=0,
                                                  messages=[{"role": "user", "content": content}])
    assert expected.choices[0].message.content  # a reply with text, not an empty one
    assert reply["content"] == expected.choices[0].message.content
    assert page.locator(".message.assistant .content").inner_text().strip()
    spans = [request["image_spans"] for frame in frames if frame.get("type") == "monitor.snapshot"
             for request in frame["requests"]]
    assert spans and all(len(found) == 1 and found[0][1] == MM_TOKENS for found in spans), spans
    assert page.log.console_errors == []


@pytest.fixture(scope="module")
def models_server(tmp_path_factory, tiny_chat_model_dir):
    """A server of a folder of two models: a-text (the tiny text model, loaded at start) and b-sees (a tiny Gemma 3
    with its image encoder, unloaded until asked for)."""
    folder = tmp_path_factory.mktemp("models")
    (folder / "a-text").symlink_to(tiny_chat_model_dir, target_is_directory=True)
    write_tiny_gemma3_vision(folder / "b-sees", seed=3, mm_tokens_per_image=MM_TOKENS)
    with running_models_server(folder, monitor_interval_s=0.1) as background:
        yield background


def test_the_attach_button_follows_the_model_picked_and_shows_once_a_model_that_sees_is_loaded(page, models_server):
    open_page(page, models_server.port)
    set_settings(page, {"temperature": "0", "max_tokens": "4"})
    assert page.input_value("#settings-fields [name=model]") == "a-text" and page.is_hidden("#attach")
    page.select_option("#settings-fields [name=model]", "b-sees")
    assert page.is_hidden("#attach")  # not loaded yet: whether it sees is not known
    page.evaluate(DROP_OR_PASTE, ["drop", list(b"\x89PNG"), "shot.png"])
    page.wait_for_selector("#attach-error:not([hidden])")
    assert page.inner_text("#attach-error").startswith("b-sees is not loaded yet")
    send(page, "hello")
    wait_reply_done(page)  # the reply loaded it: the page reads /v1/models again
    page.wait_for_selector("#attach:not([hidden])")
    page.select_option("#settings-fields [name=model]", "a-text")
    page.wait_for_selector("#attach", state="hidden")
    page.select_option("#settings-fields [name=model]", "b-sees")
    page.wait_for_selector("#attach:not([hidden])")
    assert page.log.console_errors == []
