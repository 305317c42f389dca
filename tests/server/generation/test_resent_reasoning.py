"""An agent's tool loop resends the model's reasoning with each assistant turn; the chat templates that render
reasoning (Qwen3.5's here, real template and vocabulary) keep it for the turns after the last user message, as
the model wrote them, and drop it before. Each API's spelling of it reaches the template: chat completions'
`reasoning_content` (and `reasoning`), the Responses API's `reasoning` items, Anthropic's `thinking` blocks,
Ollama's `thinking`; the same conversation makes the same prompt whatever the API. A reasoning field of the
wrong type is refused, naming it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.qwen35_serving import serve_qwen35, write_tiny_qwen35
from tests.helpers.server import post_json, post_ok

OLD, NEW = "I greet them back.", "I should look the weather up for Paris."
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": PARAMETERS}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_qwen35(write_tiny_qwen35(tmp_path_factory.mktemp("qwen35"))) as server:
        yield server


def chat_messages(reasoning: bool, field: str = "reasoning_content") -> list[dict]:
    """Hello, an answer (with reasoning: before the last user message), the question, a call (with reasoning:
    in the tool loop), its result."""
    def think(text: str) -> dict:
        return {field: text} if reasoning else {}

    return [{"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hello, how can I help?", **think(OLD)},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", **think(NEW), "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def test_the_tool_loops_reasoning_is_rendered_and_the_earlier_turns_is_not(server):
    rendered = post_ok(server.port, "/apply-template", {"messages": chat_messages(True), "tools": CHAT_TOOLS})
    assert f"<think>\n{NEW}\n</think>\n\n<tool_call>" in rendered["prompt"]
    assert OLD not in rendered["prompt"]  # before the last user message: the template drops it
    alias = post_ok(server.port, "/apply-template", {"messages": chat_messages(True, "reasoning"),
                                                     "tools": CHAT_TOOLS})
    assert alias["prompt"] == rendered["prompt"]
    # Without it (what this server rendered before), the template writes an empty think block there.
    plain = post_ok(server.port, "/apply-template", {"messages": chat_messages(False), "tools": CHAT_TOOLS})
    assert "<think>\n\n</think>\n\n<tool_call>" in plain["prompt"] and NEW not in plain["prompt"]


def prompt_tokens(server, api: str, reasoning: bool) -> int:
    """The prompt tokens of the conversation of `chat_messages` as `api` spells it (one token generated)."""
    messages = chat_messages(reasoning)
    if api == "chat":
        body = post_ok(server.port, "/v1/chat/completions", {"model": "qwen3.5", "messages": messages,
                                                              "tools": CHAT_TOOLS, "max_tokens": 1})
        return body["usage"]["prompt_tokens"]
    if api == "responses":
        items = [{"type": "message", "role": "user", "content": "Hello!"},
                 *([{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": OLD}]}]
                   if reasoning else []),
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                       "text": "Hello, how can I help?"}]},
                 {"type": "message", "role": "user", "content": "What is the weather in Paris?"},
                 *([{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": NEW}]}]
                   if reasoning else []),
                 {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                  "arguments": '{"city": "Paris"}'},
                 {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
        tools = [{"type": "function", **tool["function"]} for tool in CHAT_TOOLS]
        body = post_ok(server.port, "/v1/responses", {"model": "qwen3.5", "input": items, "tools": tools,
                                                      "max_output_tokens": 16, "store": False})
        return body["usage"]["input_tokens"]
    if api == "anthropic":
        def thinking(text: str) -> list[dict]:
            return [{"type": "thinking", "thinking": text, "signature": "sig"}] if reasoning else []

        conversation = [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": [*thinking(OLD), {"type": "text", "text": "Hello, how can I help?"}]},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [*thinking(NEW), {"type": "tool_use", "id": "call_1",
                                                               "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny, 21 C"}]}]
        tools = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": PARAMETERS}]
        body = post_ok(server.port, "/v1/messages/count_tokens", {"model": "qwen3.5", "messages": conversation,
                                                                  "tools": tools})
        return body["input_tokens"]
    ollama = [dict(message) for message in messages]
    for message in ollama:
        if "reasoning_content" in message:
            message["thinking"] = message.pop("reasoning_content")
        for call in message.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    body = post_ok(server.port, "/api/chat", {"model": "qwen3.5", "messages": ollama, "tools": CHAT_TOOLS,
                                              "stream": False, "options": {"num_predict": 1}})
    return body["prompt_eval_count"]


def test_every_api_resends_reasoning_into_the_same_prompt(server):
    counts = {api: (prompt_tokens(server, api, False), prompt_tokens(server, api, True))
              for api in ("chat", "responses", "anthropic", "ollama")}
    without, with_reasoning = counts["chat"]
    assert with_reasoning > without  # the tool loop's reasoning, in the prompt
    assert all(pair == (without, with_reasoning) for pair in counts.values()), counts


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"},
                                           {"role": "assistant", "content": "b", "reasoning_content": 5}]},
     "messages[1].reasoning_content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"},
                                           {"role": "assistant", "content": "b", "reasoning": ["x"]}]},
     "messages[1].reasoning"),
    ("/api/chat", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                                                   "thinking": {"x": 1}}], "stream": False},
     "messages[1].thinking"),
    ("/v1/messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}]},
     "messages[1].content[0].thinking"),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": [], "content": "not parts"}]}, "input[0].content"),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": [], "content": [{"type": "summary_text",
                                                                                    "text": "x"}]}]},
     "input[0].content[0]"),
])
def test_reasoning_of_the_wrong_type_is_refused_naming_it(server, path, body, param):
    status, answer = post_json(server.port, path, {"model": "qwen3.5", **body})
    assert status == 400, answer
    error = answer.get("error", answer)
    assert param in json.dumps(error), error
