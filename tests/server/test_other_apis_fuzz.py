"""A hypothesis fuzzer for the other APIs' bodies (tiny model), as tests/server/openai/test_http_fuzz.py is for
OpenAI's: random and adversarial requests to Ollama's /api/chat, /api/generate and /api/show, Anthropic's
/v1/messages and /v1/messages/count_tokens, and llama.cpp's /tokenize, /detokenize and /apply-template,
streamed or not, read whole or dropped mid-stream, over one keep-alive connection. Tool turns among them as
real clients send them: Ollama's tools beside `format`, a history holding a call (its arguments an object, or
the unfinished text an older answer held, as Open WebUI sends it back) and its result; Anthropic's tools (a
server tool among them) beside `output_config`, Claude Code's `output_config.effort` and
`context_management`, a tool_use and its tool_result; the tiny model's calls cut by the token limit.

Invariants: never a 5xx; every refusal is a 4xx in its API's error shape; every 200 parses into the
API's client types (the `ollama` client's, the `anthropic` SDK's: a call's arguments an object) or is a
well-formed stream (NDJSON
ending in `done: true` or an error; server-sent events ending in `message_stop` or an error event); the
connection stays usable after every refusal; at the end the engine is idle, every block free or cached,
no response in flight. Fixed examples pin the bounds each path checks.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter

import ollama
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from hypothesis import strategies as st
from pydantic import TypeAdapter

from tests.helpers.fuzzing import (
    anthropic_image_blocks,
    assert_server_whole,
    ollama_images,
    send_generated_requests,
)
from tests.helpers.image_fuzzing import run_vision_fuzz
from tests.helpers.json_strategies import extreme_numbers, json_values, maybe, nasty_text
from tests.helpers.server import running_server

NUM_CASES = 150
MAX_BODY_BYTES = 16 * 1024
REFUSALS = {400, 404, 405, 413, 429}
OLLAMA_PATHS = ("/api/chat", "/api/generate", "/api/show")
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
LLAMA_CPP_PATHS = ("/tokenize", "/detokenize", "/apply-template")
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)
# refusals of images the fuzzer must reach, by code: a valid image to the text-only model, a broken one
IMAGE_REFUSALS = {"image to a text model": ("model_takes_no_images",),
                  "broken image": ("invalid_image", "invalid_image_url", "image_too_large", "too_many_images")}

models = maybe(st.sampled_from(["default", "llama3", "served"]))
roles = maybe(st.sampled_from(["user", "assistant", "system", "tool", "developer"]))
options = st.fixed_dictionaries({}, optional={
    name: maybe(extreme_numbers) for name in ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty",
                                             "num_ctx", "mirostat", "typical_p", "num_thread")} | {
    "num_predict": maybe(st.integers(-2, 4) | extreme_numbers), "stop": maybe(st.lists(nasty_text, max_size=3))})
ollama_common = {"model": models, "stream": maybe(st.booleans()), "options": maybe(options),
                 "format": maybe(st.sampled_from(["", "json", "yaml", {"type": "object"}, {"type": 5}])),
                 "think": maybe(st.booleans()), "keep_alive": maybe(st.sampled_from(["5m", 0, -1])),
                 "tools": maybe(st.just([])), "unknown": json_values}
ollama_chat = st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hello"}]) | maybe(st.lists(
    st.fixed_dictionaries({"role": roles, "content": maybe(nasty_text)}, optional={"images": json_values
                                                                                 | ollama_images,
                                                                                 "thinking": maybe(nasty_text)
                                                                                 | json_values}),
    max_size=3))}, optional=ollama_common)
ollama_generate = st.fixed_dictionaries({"prompt": st.just("hello world") | maybe(nasty_text)}, optional={
    **ollama_common, "system": maybe(nasty_text), "raw": maybe(st.booleans()), "suffix": maybe(nasty_text),
    "context": maybe(st.just([1, 2])), "images": maybe(ollama_images | json_values)})
ollama_show = st.fixed_dictionaries({}, optional={"model": models, "name": models, "verbose": maybe(st.booleans())})
blocks = st.lists(st.fixed_dictionaries({"type": maybe(st.sampled_from(["text", "image", "tool_use", "tool_result",
                                                                      "thinking", "redacted_thinking"])),
                                         "text": maybe(nasty_text)}, optional={"thinking": maybe(nasty_text)})
                  | anthropic_image_blocks, max_size=2)
anthropic_messages = st.lists(st.fixed_dictionaries({"role": roles, "content": maybe(nasty_text | blocks)}),
                              max_size=3)
anthropic_prompt = {"model": models, "system": maybe(nasty_text | blocks),
                    "tools": maybe(st.just([])), "tool_choice": maybe(st.sampled_from([{"type": "auto"},
                                                                                       {"type": "any"}])),
                    "thinking": maybe(st.sampled_from([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 9}])),
                    "unknown": json_values}
anthropic_body = st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hello"}]) | maybe(
    anthropic_messages)}, optional={**anthropic_prompt, "max_tokens": maybe(st.integers(0, 4) | extreme_numbers),
                                   "stream": maybe(st.booleans()), "temperature": maybe(extreme_numbers),
                                   "top_p": maybe(extreme_numbers), "top_k": maybe(extreme_numbers),
                                   "stop_sequences": maybe(st.lists(nasty_text, max_size=3)),
                                   "metadata": maybe(st.fixed_dictionaries({}, optional={"user_id": nasty_text}))})
count_body = st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}]) | maybe(
    anthropic_messages)}, optional=anthropic_prompt)
tokenize_body = st.fixed_dictionaries({"content": st.just("hello world") | maybe(nasty_text)}, optional={
    "add_special": maybe(st.booleans()), "with_pieces": maybe(st.booleans()), "parse_special": maybe(st.booleans()),
    "model": models})
detokenize_body = st.fixed_dictionaries({"tokens": maybe(st.lists(st.integers(-2, 300) | extreme_numbers,
                                                                  max_size=6))}, optional={"model": models})
template_body = st.fixed_dictionaries({"messages": maybe(st.lists(st.fixed_dictionaries(
    {"role": roles, "content": maybe(nasty_text)}), max_size=3))})
valid_chat = st.tuples(st.just("/api/chat"), st.fixed_dictionaries({
    "model": st.just("served"), "stream": st.booleans(), "messages": st.just([{"role": "user", "content": "hello"}])},
    optional={"options": st.fixed_dictionaries({"num_predict": st.integers(1, 4)}, optional={
        "temperature": st.floats(0, 2), "seed": st.integers(0, 9)})}))
valid_generate = st.tuples(st.just("/api/generate"), st.fixed_dictionaries({
    "model": st.just("served"), "prompt": st.just("hi"), "stream": st.booleans()}, optional={"raw": st.booleans()}))
valid_message = st.tuples(st.just("/v1/messages"), st.fixed_dictionaries({
    "model": st.just("served"), "max_tokens": st.integers(1, 4), "stream": st.booleans(),
    "messages": st.just([{"role": "user", "content": "hello"}])}, optional={"temperature": st.floats(0, 1)}))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ollama_history = st.builds(lambda arguments, answered: [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": arguments}}]},
    *([{"role": "tool", "content": "sunny", "tool_name": "get_weather"}] if answered else [])],
    st.sampled_from([{"city": "Paris"}, '{"city": "Par', 5]), st.booleans())
ollama_tools = st.tuples(st.just("/api/chat"), st.fixed_dictionaries({
    "model": st.just("served"), "messages": st.just([{"role": "user", "content": "hello"}]) | ollama_history},
    optional={"tools": st.just([WEATHER]), "format": st.sampled_from(["json", SCHEMA]), "stream": st.booleans()}))
anthropic_history = st.just([
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}])
anthropic_tools = st.tuples(st.just("/v1/messages"), st.fixed_dictionaries({
    "model": st.just("served"), "max_tokens": st.integers(1, 4),
    "messages": st.just([{"role": "user", "content": "hello"}]) | anthropic_history}, optional={
    "tools": st.sampled_from([[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                              [{"type": "web_search_20250305", "name": "web_search"}]]),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}]),
    "output_config": st.sampled_from([{"effort": "high"}, {"effort": "low"},
                                      {"effort": "high", "format": {"type": "json_schema", "schema": SCHEMA}}]),
    "context_management": st.sampled_from([{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                                           {"edits": [{"type": "clear_tool_uses_20250919"}]}, {"edits": 5}]),
    "stream": st.booleans()}))
image_requests = st.one_of(  # images, valid and broken, in otherwise valid requests to the text-only model
    st.tuples(st.just("/api/chat"), st.fixed_dictionaries({"model": st.just("served"), "messages": st.lists(
        st.fixed_dictionaries({"role": st.just("user"), "content": nasty_text, "images": ollama_images}),
        min_size=1, max_size=2)}, optional={"stream": st.booleans()})),
    st.tuples(st.just("/api/generate"), st.fixed_dictionaries({"model": st.just("served"), "prompt": nasty_text,
                                                               "images": ollama_images},
                                                              optional={"raw": st.booleans()})),
    st.tuples(st.just("/v1/messages"), st.fixed_dictionaries({
        "model": st.just("served"), "max_tokens": st.just(2), "messages": st.lists(st.fixed_dictionaries({
            "role": st.just("user"), "content": st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                "text": nasty_text})
                                                         | anthropic_image_blocks, min_size=1, max_size=3)}),
            min_size=1, max_size=2)})),
)
fuzzed = st.one_of(
    st.tuples(st.just("/api/chat"), ollama_chat), st.tuples(st.just("/api/generate"), ollama_generate),
    st.tuples(st.just("/api/show"), ollama_show), st.tuples(st.just("/v1/messages"), anthropic_body),
    st.tuples(st.just("/v1/messages/count_tokens"), count_body), st.tuples(st.just("/tokenize"), tokenize_body),
    st.tuples(st.just("/detokenize"), detokenize_body), st.tuples(st.just("/apply-template"), template_body))
too_large = st.integers(MAX_BODY_BYTES + 1, 2 * MAX_BODY_BYTES).map(lambda size: json.dumps({"x": "x" * size}).encode())
raw_bodies = st.tuples(st.sampled_from([*OLLAMA_PATHS, *ANTHROPIC_PATHS, *LLAMA_CPP_PATHS]),
                       st.binary(max_size=40) | json_values.map(json.dumps).map(str.encode) | too_large)
# drawn by weight: half valid (so every kind of answer comes, streams on both APIs among them), fuzzed
# fields, raw bytes
streamed_message = st.tuples(st.just("/v1/messages"), st.fixed_dictionaries({
    "model": st.just("served"), "max_tokens": st.integers(1, 4), "stream": st.just(True),
    "messages": st.just([{"role": "user", "content": "hello"}])}))
streamed_chat = st.tuples(st.just("/api/chat"), st.fixed_dictionaries({
    "model": st.just("served"), "messages": st.just([{"role": "user", "content": "hello"}])}))
encoded = [strategy.map(lambda pair: (pair[0], json.dumps(pair[1]).encode()))
           for strategy in (valid_chat, valid_generate, valid_message, streamed_message, streamed_chat, ollama_tools,
                            anthropic_tools, fuzzed, image_requests)]
# streamed Anthropic messages weighed twice: the SDK's events must come often enough to be checked
requests = st.sampled_from([*encoded[:7], encoded[3], encoded[7], encoded[7], encoded[7], encoded[7], encoded[8],
                            encoded[8], raw_bodies]).flatmap(lambda chosen: chosen)


def check_error(path: str, body: bytes) -> None:
    """A refusal in the error shape of `path`'s API."""
    error = json.loads(body)
    if path.startswith("/api/"):
        assert isinstance(error["error"], str) and error["error"] and "code" in error, error
    elif path in ANTHROPIC_PATHS:
        assert error["type"] == "error" and error["error"]["type"] and error["error"]["message"], error
    else:
        assert set(error["error"]) == {"message", "type", "param", "code"}, error


def check_whole(path: str, body: bytes) -> None:
    answer = json.loads(body)
    if path == "/api/chat":  # the client refuses a call whose arguments are no object
        assert ollama.ChatResponse.model_validate(answer).done
    elif path == "/api/generate":
        assert ollama.GenerateResponse.model_validate(answer).done
    elif path == "/api/show":
        ollama.ShowResponse.model_validate(answer)
    elif path == "/v1/messages":
        assert all(isinstance(block.input, dict) for block in Message.model_validate(answer).content
                   if block.type == "tool_use")
    elif path == "/v1/messages/count_tokens":
        assert MessageTokensCount.model_validate(answer).input_tokens > 0
    elif path == "/tokenize":
        assert isinstance(answer["tokens"], list)
    elif path == "/detokenize":
        assert isinstance(answer["content"], str)
    else:
        assert isinstance(answer["prompt"], str)


class Fuzzer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.connection: http.client.HTTPConnection | None = None
        self.outcomes: Counter[str] = Counter()
        self.refusals: list[tuple[int, str | None, str | None]] = []  # (status, code, param) of each

    def send(self, path: str, body: bytes, drop_after: int | None) -> None:
        if self.connection is None:
            self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        self.connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        status, content_type = response.status, response.getheader("Content-Type", "")
        assert status == 200 or status in REFUSALS, (path, status, response.read()[:300])
        kind = "ndjson" if "ndjson" in content_type else "sse" if "event-stream" in content_type else "whole"
        self.outcomes[str(status) if status != 200 else kind] += 1
        if status != 200:
            data = response.read()
            check_error(path, data)
            error = json.loads(data)
            inner = error if path.startswith("/api/") else error["error"]
            code = inner.get("code")
            self.refusals.append((status, code, inner.get("param")))
            for kind, codes in IMAGE_REFUSALS.items():
                self.outcomes[kind] += code in codes
        elif kind == "whole":
            check_whole(path, response.read())
        elif not (self.read_ndjson(response, drop_after) if kind == "ndjson" else
                  self.read_events(response, drop_after)):
            return self.reconnect()
        if response.will_close:
            self.reconnect()

    @staticmethod
    def read_ndjson(response, drop_after: int | None) -> bool:
        """Ollama's stream to its end (True), or dropped after a few lines (False)."""
        count = 0
        while line := response.readline():
            count += 1
            if drop_after is not None and count >= drop_after:
                return False
            item = json.loads(line)
            if "error" in item:
                assert item["code"] != "server_error", item
                break
            (ollama.ChatResponse if "message" in item else ollama.GenerateResponse).model_validate(item)  # every line
            if item["done"]:
                break
        assert response.read() == b""
        return True

    @staticmethod
    def read_events(response, drop_after: int | None) -> bool:
        """Anthropic's events to `message_stop` (True), or dropped after a few (False)."""
        count = 0
        while line := response.readline():
            if not line.startswith(b"data: "):
                assert line == b"\n" or line.startswith(b"event: "), line
                continue
            count += 1
            if drop_after is not None and count >= drop_after:
                return False
            event = json.loads(line[6:])
            if event["type"] == "error":
                assert event["error"]["type"] != "api_error", event
                break
            if event["type"] != "ping":  # a keep-alive the SDK skips, outside its union of events
                STREAM_EVENT.validate_python(event)
            if event["type"] == "message_stop":
                break
        assert response.read() == b"\n"
        return True

    def reconnect(self) -> None:
        if self.connection is not None:
            self.connection.close()
        self.connection = None


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, model_alias="served", max_message_bytes=MAX_BODY_BYTES,
                        default_max_output_tokens=4, send_timeout_s=5.0) as server:
        yield server


def test_other_api_bodies_never_break_the_server(server):
    fuzzer = Fuzzer(server.port)
    send_generated_requests(fuzzer, requests, NUM_CASES)
    # A broken image is not drawn in every run (seen once in ~7): it is pinned below (test_each_bound_of_the_new_paths)
    # and drawn in half the cases of the vision fuzzer (test_image_parts_to_a_model_that_takes_images).
    assert min(fuzzer.outcomes[kind] for kind in ("ndjson", "sse", "whole", "400", "image to a text model")) >= 1, \
        fuzzer.outcomes
    # Image parts take a share of the draws since issue 38: a full run saw only 4 streamed Anthropic answers
    # in 191 cases, so the bound asks for a few of each answer kind, not 5.
    assert min(fuzzer.outcomes[kind] for kind in ("ndjson", "sse", "whole", "400")) >= 2, fuzzer.outcomes
    assert_server_whole(server)


VISION_CASES = 300


def test_image_parts_to_a_model_that_takes_images(image_fuzz_server):
    """Ollama's chat and generate, Anthropic's messages and count_tokens and llama.cpp's /apply-template holding
    images (tests/helpers/image_parts.py) to a tiny Gemma 3: each answered or refused by the rules, naming the
    part; clients that vanish or never read; at the end the engine idle, every block back, the image embeddings
    cache within its bound."""
    fuzzer = run_vision_fuzz(Fuzzer(image_fuzz_server.port), image_fuzz_server,
                             ("ollama_chat", "ollama_generate", "anthropic", "anthropic_count", "apply_template"),
                             VISION_CASES)
    outcomes = fuzzer.fuzzer.outcomes
    assert outcomes["ndjson"] + outcomes["sse"] + outcomes["whole"] >= 5, outcomes


@pytest.mark.parametrize("path, body, status, param", [
    # each bound and rule of the new paths, pinned
    ("/api/chat", {"model": "served", "messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 1)}]}, 413,
     None),
    ("/api/chat", {"model": "served", "messages": [{"role": "user", "content": "hi"}], "options": {"num_ctx": 2}},
     400, "messages"),
    ("/api/chat", {"model": "served", "messages": [{"role": "user", "content": "hi"}],
                   "options": {"num_predict": 10**6}}, 400, "options.num_predict"),
    ("/api/generate", {"model": "served", "prompt": "hi", "options": {"num_predict": -3}}, 400,
     "options.num_predict"),
    ("/api/generate", {"model": "served", "prompt": "hi", "context": [1]}, 400, "context"),
    ("/api/show", {}, 400, "model"),
    ("/v1/messages", {"model": "served", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                      "temperature": 2.5}, 400, "temperature"),
    ("/v1/messages", {"model": "served", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                      "stop_sequences": ["x"] * 100}, 400, "stop_sequences"),
    ("/v1/messages/count_tokens", {"model": "served", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 3}, 400, "max_tokens"),
    ("/detokenize", {"tokens": [10**20]}, 400, "tokens[0]"),
    # found by the fuzzer (a 500): blocks in a message whose role is not a string
    ("/v1/messages", {"model": "served", "max_tokens": 2, "messages": [{"role": [], "content": [None]}]}, 400,
     "messages[0].content[0]"),
    ("/tokenize", {"content": ["a", "b"]}, 400, "content"),
    # a broken image to the text model: refused as broken (its part named) before the model is asked
    ("/api/chat", {"model": "served", "messages": [{"role": "user", "content": "hi", "images": ["bm90IGFuIGltYWdl"]}]},
     400, "messages[0].images[0]"),
    ("/v1/messages", {"model": "served", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]}]},
     400, "messages[0].content[0]"),
])
def test_each_bound_of_the_new_paths(server, path, body, status, param):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    assert response.status == status, data
    check_error(path, data)
    error = json.loads(data)
    got_param = error.get("param") if path.startswith("/api/") else error["error"].get("param")
    assert param is None or got_param == param, error
