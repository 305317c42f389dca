"""The chat in a real Chromium against a real server on the tiny chat model (steps slowed so a reply
takes a while): the page loads with no console error, a message streams its reply into the page (the
same text the API gives for the same request), the settings show the server's defaults, conversations
are kept across a reload and can be renamed and deleted, a reply can be regenerated and a message edited
and sent again, and Stop ends the request with every block back in the pool (/slots). Against a server of
a folder of two tiny models: the settings' model picker lists /v1/models with each model's status, a
message goes to the model picked (its reply is that model's, as the API gives it), the statuses follow
the switch, and the choice is kept across a reload."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers.browser import slowed
from tests.helpers.server import make_llm, running_models_server, running_server, write_tiny_chat_model
from tests.helpers.webui_page import get_json, last_reply, open_page, send, set_settings, wait_reply_done

STEP_DELAY_S = 0.02
SETTINGS = {"temperature": "0", "max_tokens": "40"}


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    llm = slowed(make_llm(tiny_chat_model_dir, max_model_len=512), STEP_DELAY_S)
    with running_server(llm, monitor_interval_s=0.1) as background:
        yield background


def test_the_page_loads_clean_and_a_message_streams_its_reply(page, server):
    open_page(page, server.port)
    page.wait_for_function("() => document.querySelector('#map-title').textContent.includes('256 × 16')")
    set_settings(page, SETTINGS)
    send(page, "hello world what is the capital of france")
    lengths = set()
    while not page.locator(".message.assistant .regenerate").count():
        lengths.add(len(last_reply(page).locator(".content").inner_text()))
        time.sleep(0.02)
    shown = last_reply(page).locator(".content").inner_text()
    expected = get_json(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello world what is the capital of france"}],
        "temperature": 0, "max_tokens": 40})
    assert shown.strip() == expected["choices"][0]["message"]["content"].strip()
    assert len(lengths) >= 3, lengths  # it grew while it was generated, not all at once
    stats = last_reply(page).locator(".stats")
    assert stats.get_attribute("data-completion-tokens") == str(expected["usage"]["completion_tokens"])
    assert stats.get_attribute("data-prompt-tokens") == str(expected["usage"]["prompt_tokens"])
    assert "tokens/s" in stats.inner_text()
    assert page.log.console_errors == []


def test_the_settings_show_the_servers_defaults(page, server):
    open_page(page, server.port)
    defaults = get_json(server.port, "/v1/models")["data"][0]["sampling_defaults"]
    page.click("#settings summary")
    for name in ("temperature", "top_p", "top_k", "min_p"):
        value = defaults[name]
        expected = "off" if value is None else f"default {value}"
        assert page.get_attribute(f"#settings-fields [name={name}]", "placeholder") == expected


def test_conversations_are_kept_renamed_and_deleted(page, server):
    open_page(page, server.port)
    set_settings(page, SETTINGS)
    send(page, "tell me a story about the moon")
    wait_reply_done(page)
    page.click("#new-chat")
    send(page, "say hi")
    wait_reply_done(page)
    titles = page.locator("#conversation-list .title")
    assert titles.all_inner_texts() == ["say hi", "tell me a story about the moon"]
    page.once("dialog", lambda dialog: dialog.accept("Moon story"))
    page.locator("#conversation-list li").nth(1).locator(".rename").click()
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert titles.all_inner_texts() == ["Moon story", "say hi"]  # renamed is newest now
    assert page.locator(".message.user .text").all_inner_texts() == ["say hi"]  # the open one, as it was
    page.locator("#conversation-list li").nth(0).locator(".title").click()
    assert page.locator(".message.user .text").all_inner_texts() == ["tell me a story about the moon"]
    page.locator("#conversation-list li").nth(0).locator(".delete").click()
    assert titles.all_inner_texts() == ["say hi"]
    stored = json.loads(page.evaluate("localStorage.getItem('localserve.conversations')"))
    assert [conversation["title"] for conversation in stored] == ["say hi"]


def test_regenerate_and_edit_and_resend(page, server):
    open_page(page, server.port)
    set_settings(page, {"temperature": "1", "max_tokens": "12"})
    send(page, "hello")
    wait_reply_done(page)
    first = last_reply(page).locator(".content").inner_text()
    page.click(".message.assistant .regenerate")
    wait_reply_done(page)
    assert page.locator(".message").count() == 2  # the reply replaced, not added
    set_settings(page, {"temperature": "0"})
    page.click(".message.user .edit")
    page.fill(".message.user textarea.edit", "what is the capital of france")
    page.click(".message.user .resend")
    wait_reply_done(page)
    assert page.locator(".message.user .text").all_inner_texts() == ["what is the capital of france"]
    expected = get_json(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "what is the capital of france"}], "temperature": 0, "max_tokens": 12})
    shown = last_reply(page).locator(".content").inner_text()
    assert shown.strip() == expected["choices"][0]["message"]["content"].strip()
    assert first  # the first reply had text too


def test_stop_during_a_reply_frees_every_block(page, server):
    open_page(page, server.port)
    set_settings(page, {"max_tokens": "400", "temperature": "0"})
    send(page, "tell me a story about the sun and the moon and the sky")
    page.wait_for_function("() => document.querySelector('.message.assistant .content').textContent.length > 20")
    during = get_json(server.port, "/slots")
    assert len(during["requests"]) == 1 and during["blocks"]["num_used_blocks"] > 0
    page.click("#stop")
    page.wait_for_selector(".message.assistant .stopped")
    deadline = time.monotonic() + 5
    while (after := get_json(server.port, "/slots"))["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after["requests"] == [] and after["blocks"]["num_used_blocks"] == 0
    blocks = after["blocks"]
    assert blocks["num_free_blocks"] + blocks["num_cached_blocks"] == blocks["num_blocks"]  # all in the free queue
    stopped_text = last_reply(page).locator(".content").inner_text()
    time.sleep(0.3)
    assert last_reply(page).locator(".content").inner_text() == stopped_text  # nothing more arrived
    assert page.is_hidden("#stop") and page.is_enabled("#send")


QUESTION = "hello world what is the capital of france"


@pytest.fixture(scope="module")
def models_server(tmp_path_factory, tiny_chat_model_dir):
    """A server of a folder of two tiny models: tiny-a (loaded at start) and tiny-b."""
    folder = tmp_path_factory.mktemp("models")
    (folder / "tiny-a").symlink_to(tiny_chat_model_dir, target_is_directory=True)
    write_tiny_chat_model(folder / "tiny-b", seed=2)
    with running_models_server(folder, monitor_interval_s=0.1) as background:
        yield background


def options(page) -> list[str]:
    return page.locator("#settings-fields [name=model] option").all_inner_texts()


def test_the_picker_lists_the_models_and_a_message_goes_to_the_one_picked(page, models_server):
    open_page(page, models_server.port)
    set_settings(page, {"temperature": "0", "max_tokens": "12"})
    assert options(page) == ["tiny-a · loaded", "tiny-b · unloaded"]
    assert page.input_value("#settings-fields [name=model]") == "tiny-a"  # the server's default
    page.select_option("#settings-fields [name=model]", "tiny-b")
    assert page.inner_text("#model-name") == "tiny-b · unloaded"
    send(page, QUESTION)
    wait_reply_done(page)
    body = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 12}
    expected = {name: get_json(models_server.port, "/v1/chat/completions", body | {"model": name})
                for name in ("tiny-b", "tiny-a")}  # tiny-b first: it is loaded now
    assert expected["tiny-a"]["choices"][0]["message"]["content"] != expected["tiny-b"]["choices"][0]["message"][
        "content"]
    shown = last_reply(page).locator(".content").inner_text()
    assert shown.strip() == expected["tiny-b"]["choices"][0]["message"]["content"].strip()
    page.focus("#settings-fields [name=model]")  # opening the picker lists the statuses afresh
    page.wait_for_function("() => document.querySelector('#settings-fields [name=model]').textContent"
                           ".includes('tiny-a · loaded')")
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.input_value("#settings-fields [name=model]") == "tiny-b"  # the choice is kept
    assert page.log.console_errors == []
