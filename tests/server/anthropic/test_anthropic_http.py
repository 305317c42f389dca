"""Anthropic's Messages API against the official `anthropic` SDK (tiny model, a server with an API key the
SDK sends as `x-api-key`): messages whole and streamed (every event parsed by the SDK), stop sequences
named, count_tokens, refusals in Anthropic's error shape raised as the SDK's own errors. Greedy text is
the same over Ollama's chat, Anthropic's messages and chat completions for the same conversation."""

from __future__ import annotations

import anthropic
import ollama
import pytest
from anthropic.types import Message

from tests.helpers.server import post_json, running_server

API_KEY = "sekrit-key"
PROMPT = "hello world tell me a story about the cat and the dog"
SYSTEM = "you are a helpful assistant"
MESSAGES = [{"role": "user", "content": PROMPT}]
GREEDY = {"temperature": 0}  # the SDK 2.x has no sampling arguments: sent as extra_body, as older clients send them


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, model_alias="tiny-chat", api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=API_KEY, max_retries=0,
                             timeout=60) as client:
        yield client


def post(port: int, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    return post_json(port, path, body, {"x-api-key": API_KEY, **(headers or {})})


def create(client, max_tokens: int = 12, **fields) -> Message:
    return client.messages.create(model="tiny-chat", max_tokens=max_tokens, system=SYSTEM, messages=MESSAGES,
                                  extra_body=GREEDY, **fields)


def prompt_tokens(message: Message) -> int:
    """Anthropic counts the prompt's tokens read from the cache apart from its input tokens."""
    usage = message.usage
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_greedy_text_is_the_same_over_ollama_anthropic_and_chat_completions(server, client):
    message = create(client)
    chat = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60,
                         headers={"Authorization": f"Bearer {API_KEY}"}).chat(
        model="tiny-chat", messages=[{"role": "system", "content": SYSTEM}, *MESSAGES],
        options={"temperature": 0, "num_predict": 12})
    status, completion = post(server.port, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": SYSTEM}, *MESSAGES], "temperature": 0, "max_tokens": 12},
        {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200
    texts = {message.content[0].text, chat.message.content, completion["choices"][0]["message"]["content"]}
    assert len(texts) == 1 and texts != {""}, texts
    assert prompt_tokens(message) == chat.prompt_eval_count == completion["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat.eval_count == completion["usage"]["completion_tokens"]


def test_a_message_whole(client):
    message = create(client)
    assert isinstance(message, Message) and message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "tiny-chat"
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert (message.stop_reason == "max_tokens") == (message.usage.output_tokens == 12)


def test_a_message_streamed_adds_up_to_the_whole(client):
    whole = create(client)
    with client.messages.stream(model="tiny-chat", max_tokens=12, system=SYSTEM, messages=MESSAGES,
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert kinds.count("content_block_stop") == 1 and "message_delta" in kinds
    deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
    # The server coalesces what the engine produced while the client was not reading (docs/PROTOCOL.md), so
    # 12 tokens of a tiny model may arrive as one delta when the engine outruns the first write (seen once
    # in a full run): at least one, and together exactly the whole answer.
    assert len(deltas) >= 1 and "".join(deltas) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(events[0].message) == prompt_tokens(whole)


def test_a_stop_sequence_is_named(client):
    words = create(client, max_tokens=20).content[0].text.split()
    assert len(words) >= 3
    stopped = create(client, max_tokens=20, stop_sequences=["zzz", words[2]])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == words[2]
    assert words[2] not in stopped.content[0].text.split()


def test_count_tokens_counts_the_prompt_the_message_reads(client, tiny_chat_llm):
    counted = client.messages.count_tokens(model="tiny-chat", system=SYSTEM, messages=MESSAGES)
    expected = len(tiny_chat_llm.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, *MESSAGES]))
    assert counted.input_tokens == expected == prompt_tokens(create(client))
    blocks = client.messages.count_tokens(model="tiny-chat", system=[{"type": "text", "text": SYSTEM}],
                                          messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}])
    assert blocks.input_tokens == expected


def test_the_sdk_raises_refusals_as_its_own_errors(server, client):
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=MESSAGES)
    assert raised.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="wrong", max_retries=0).messages.create(
            model="tiny-chat", max_tokens=4, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="tiny-chat", max_tokens=4, messages=MESSAGES,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert raised.value.body["error"]["param"] == "tools[0].type"


@pytest.mark.parametrize("body, status, error_type, param", [
    ({"model": "tiny-chat", "messages": MESSAGES}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "tiny-chat", "max_tokens": 4}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 4, "messages": MESSAGES}, 400, "invalid_request_error", "model"),
    ({"model": "tiny-chat", "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": "tiny-chat", "max_tokens": 0, "messages": MESSAGES}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "tiny-chat", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "messages[0].role"),
    ({"model": "tiny-chat", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "42"}]}]}, 400, "invalid_request_error", "messages"),
    ({"model": "tiny-chat", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error", "messages[0].content[0].source.type"),
    ({"model": "tiny-chat", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "invalid_request_error",
     "messages[0].content[0]"),
    ({"model": "tiny-chat", "max_tokens": 4, "messages": MESSAGES, "thinking": {"type": "sometimes"}},
     400, "invalid_request_error", "thinking.type"),
    ({"model": "tiny-chat", "max_tokens": 4, "messages": MESSAGES, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "tool_choice"),
    ({"model": "tiny-chat", "max_tokens": 4, "messages": MESSAGES, "stop_sequences": [1]}, 400,
     "invalid_request_error", "stop_sequences"),
    ({"model": "tiny-chat", "max_tokens": 4, "messages": MESSAGES, "frobnicate": 1}, 400,
     "invalid_request_error", "frobnicate"),
    ({"model": "tiny-chat", "max_tokens": 10**6, "messages": MESSAGES}, 400, "invalid_request_error", "max_tokens"),
])
def test_refusals_come_in_anthropics_error_shape(server, body, status, error_type, param):
    got, error = post(server.port, "/v1/messages", body)
    assert got == status and error["type"] == "error", error
    assert error["error"]["type"] == error_type and error["error"]["message"] and error["error"]["param"] == param


def test_ignored_fields_change_nothing(client):
    plain = create(client)
    dressed = create(client, metadata={"user_id": "u1"}, service_tier="auto",
                     extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
                     tool_choice={"type": "auto"}, thinking={"type": "disabled"})
    assert dressed.content[0].text == plain.content[0].text
