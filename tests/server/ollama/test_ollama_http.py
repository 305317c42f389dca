"""Ollama's API against the official `ollama` Python client (tiny model): chat streamed and not,
generate (templated and raw), tags, show, ps, version; `options` reach the engine (num_predict, stop,
seed, num_ctx); refusals come in Ollama's error shape and the client raises them as `ResponseError`.
Every answer is parsed by the client into its own pydantic types. The references: chat completions
and text completions over the OpenAI paths (greedy text equal), the model's files (sizes, parameters)
and its tokenizer (prompt tokens)."""

from __future__ import annotations

import http.client
import json
import math

import ollama
import pytest
from safetensors import safe_open

from tests.helpers.server import post_raw as post
from tests.helpers.server import running_server

PROMPT = "hello world tell me a story about the cat and the dog"
SYSTEM = "you are a helpful assistant"
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, model_alias="tiny-chat") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)


def openai_chat(port: int, messages: list[dict], max_tokens: int = 12) -> dict:
    status, data = post(port, "/v1/chat/completions", {"messages": messages, "temperature": 0,
                                                       "max_tokens": max_tokens})
    assert status == 200, data
    return json.loads(data)


def test_chat_whole_matches_chat_completions_and_counts_its_tokens(server, client, tiny_chat_llm):
    answer = client.chat(model="tiny-chat", messages=CONVERSATION, stream=False, options=GREEDY)
    assert isinstance(answer, ollama.ChatResponse) and answer.done and answer.model == "tiny-chat"
    reference = openai_chat(server.port, CONVERSATION)
    assert answer.message.role == "assistant" and answer.message.content == reference["choices"][0]["message"][
        "content"]
    assert answer.prompt_eval_count == len(tiny_chat_llm.tokenizer.encode_chat(CONVERSATION))
    assert answer.prompt_eval_count == reference["usage"]["prompt_tokens"]
    assert answer.eval_count == reference["usage"]["completion_tokens"]
    assert answer.done_reason == {"stop": "stop", "length": "length"}[reference["choices"][0]["finish_reason"]]
    assert answer.total_duration >= answer.eval_duration >= 0 and answer.load_duration == 0


def test_chat_streamed_adds_up_to_the_whole_answer(client):
    whole = client.chat(model="tiny-chat", messages=CONVERSATION, stream=False, options=GREEDY)
    parts = list(client.chat(model="tiny-chat", messages=CONVERSATION, stream=True, options=GREEDY))
    assert all(not part.done for part in parts[:-1]) and parts[-1].done and parts[-1].done_reason == whole.done_reason
    assert "".join(part.message.content for part in parts) == whole.message.content
    assert len(parts) >= 3  # the text came in pieces, then the last object
    assert parts[-1].eval_count == whole.eval_count and parts[-1].prompt_eval_count == whole.prompt_eval_count


def test_generate_is_a_user_turn_and_raw_is_a_text_completion(server, client):
    templated = client.generate(model="tiny-chat", prompt=PROMPT, system=SYSTEM, options=GREEDY)
    assert isinstance(templated, ollama.GenerateResponse) and templated.done
    assert templated.response == openai_chat(server.port, CONVERSATION)["choices"][0]["message"]["content"]
    raw = client.generate(model="tiny-chat", prompt=PROMPT, raw=True, options=GREEDY)
    status, data = post(server.port, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 12})
    assert status == 200 and raw.response == json.loads(data)["choices"][0]["text"]
    streamed = list(client.generate(model="tiny-chat", prompt=PROMPT, raw=True, options=GREEDY, stream=True))
    assert "".join(part.response for part in streamed) == raw.response and streamed[-1].done


def test_options_reach_the_engine(client):
    three = client.chat(model="tiny-chat", messages=CONVERSATION, options={**GREEDY, "num_predict": 3})
    assert three.eval_count == 3 and three.done_reason == "length"
    longer = client.chat(model="tiny-chat", messages=CONVERSATION, options=GREEDY)
    words = longer.message.content.split()
    assert len(words) >= 3
    stopped = client.chat(model="tiny-chat", messages=CONVERSATION, options={**GREEDY, "stop": [words[2]]})
    assert stopped.done_reason == "stop" and longer.message.content.startswith(stopped.message.content)
    assert words[2] not in stopped.message.content.split()
    sampled = [client.chat(model="tiny-chat", messages=CONVERSATION,
                           options={"temperature": 1.5, "seed": 7, "num_predict": 8, "top_k": 0, "top_p": 1.0,
                                    "repeat_penalty": 1.1, "min_p": 0.0})
               for _ in range(2)]
    assert sampled[0].message.content == sampled[1].message.content  # a seed makes sampling repeatable
    unlimited = client.chat(model="tiny-chat", messages=CONVERSATION, options={"temperature": 0, "num_predict": -1})
    assert unlimited.done and unlimited.message.content.startswith(longer.message.content)


def test_num_ctx_bounds_the_prompt_and_output(client):
    prompt_tokens = client.chat(model="tiny-chat", messages=CONVERSATION, options=GREEDY).prompt_eval_count
    fitted = client.chat(model="tiny-chat", messages=CONVERSATION,
                         options={"temperature": 0, "num_ctx": prompt_tokens + 2})
    assert fitted.eval_count == 2 and fitted.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="tiny-chat", messages=CONVERSATION, options={"num_ctx": prompt_tokens})
    assert raised.value.status_code == 400 and "'options.num_ctx' holds" in raised.value.error
    huge = client.chat(model="tiny-chat", messages=CONVERSATION, options={**GREEDY, "num_ctx": 10**6})
    assert huge.done  # cut to the model's context, as Ollama does


def test_tags_show_ps_and_version_describe_the_model(server, client, tiny_chat_model_dir, tiny_chat_llm):
    listed = client.list()
    assert isinstance(listed, ollama.ListResponse) and [model.model for model in listed.models] == ["tiny-chat"]
    entry = listed.models[0]
    weights = sorted(tiny_chat_model_dir.glob("*.safetensors"))
    assert entry.size == sum(path.stat().st_size for path in weights)
    assert entry.details.family == "llama" and entry.details.format == "safetensors"
    parameters = 0
    for path in weights:
        with safe_open(path, "pt") as tensors:
            parameters += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    shown = client.show("tiny-chat")
    assert isinstance(shown, ollama.ShowResponse)
    assert shown.modelinfo["general.parameter_count"] == parameters
    assert shown.modelinfo["llama.context_length"] >= 512 and shown.modelinfo["general.architecture"] == "llama"
    assert shown.capabilities == ["completion", "tools"]  # a chat format (any can be offered tools), no reasoning
    assert shown.template == tiny_chat_llm.tokenizer.chat_template
    running = client.ps()
    assert [model.model for model in running.models] == ["tiny-chat"]
    assert running.models[0].size_vram >= entry.size
    status, data = post(server.port, "/api/version", {})
    assert status == 405
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("GET", "/api/version")
    assert json.loads(connection.getresponse().read())["version"].count(".") == 2


def test_a_request_with_nothing_to_say_loads_the_model(server):
    for path, empty in (("/api/chat", {"messages": []}), ("/api/generate", {"prompt": ""})):
        status, data = post(server.port, path, {"model": "tiny-chat", **empty})
        answer = json.loads(data)
        assert status == 200 and answer["done"] and answer["done_reason"] == "load", answer


@pytest.mark.parametrize("body, status, param", [
    ({"model": "llama3", "messages": CONVERSATION}, 404, "model"),
    ({"messages": CONVERSATION}, 400, "model"),
    ({"model": "tiny-chat", "messages": CONVERSATION, "tools": [{"type": "retrieval"}]}, 400, "tools[0].type"),
    ({"model": "tiny-chat", "messages": CONVERSATION, "think": "max"}, 400, "think"),
    ({"model": "tiny-chat", "messages": CONVERSATION, "format": "yaml"}, 400, "format"),
    ({"model": "tiny-chat", "messages": CONVERSATION, "options": {"mirostat": 2}}, 400, "options.mirostat"),
    ({"model": "tiny-chat", "messages": CONVERSATION, "options": {"num_ctx": 0}}, 400, "options.num_ctx"),
    ({"model": "tiny-chat", "messages": CONVERSATION, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ({"model": "tiny-chat", "messages": CONVERSATION, "options": {"bogus": 1}}, 400, "options.bogus"),
    ({"model": "tiny-chat", "messages": [{"role": "tool", "content": "42"}]}, 400, "messages[0]"),
    ({"model": "tiny-chat", "messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": 5}}]}]}, 400, "messages[0].tool_calls[0].function.arguments"),
    ({"model": "tiny-chat", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400,
     "messages[0].images[0]"),  # base64 of "hi": no image
])
def test_refusals_come_in_ollamas_error_shape(server, body, status, param):
    got, data = post(server.port, "/api/chat", body)
    error = json.loads(data)
    assert got == status and isinstance(error["error"], str) and error["error"] and error["param"] == param, error


def test_the_client_raises_a_refusal_with_its_message(client):
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="llama3", messages=CONVERSATION)
    assert raised.value.status_code == 404 and "'llama3' not found" in raised.value.error
    with pytest.raises(ollama.ResponseError) as raised:
        client.generate(model="tiny-chat", prompt=PROMPT, raw=True, system=SYSTEM)
    assert raised.value.status_code == 400 and "raw" in raised.value.error
