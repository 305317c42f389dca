"""Ollama's, Anthropic's and llama.cpp's paths on the HTTP API as an ASGI app (tests/helpers/http_api.py: a
real GenerationService on a recorded engine thread, no model): what each field becomes in the engine's
SamplingParams (Ollama's options, `format`, Anthropic's sampling fields and `output_config.format`), the
stream types and their endings (a failure or a shutdown ends the stream in the API's own shape), the
access refusals in each API's error shape, and the request's one log line."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.request.sampling_rules import INT64_MAX
from tests.helpers.http_api import API_KEY, Api, response, run

CHAT = {"model": "served", "messages": [{"role": "user", "content": "hi"}]}
MESSAGE = {"model": "served", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def submitted_params(api: Api, path: str, body: dict):
    run(api.answered(path, body, ["x"]))
    return api.engine.submissions[-1].params


def test_ollama_options_become_the_engines_sampling():
    params = submitted_params(Api(), "/api/chat", {**CHAT, "stream": False, "options": {
        "temperature": 0.5, "top_k": 7, "top_p": 0.9, "min_p": 0.05, "seed": 11, "stop": ["a", "b"],
        "repeat_penalty": 1.2, "num_predict": 3, "presence_penalty": 0.1, "frequency_penalty": 0.2,
        "num_thread": 8, "num_gpu": 99}, "keep_alive": "5m"})
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.seed) == (0.5, 7, 0.9, 0.05, 11)
    assert params.stop == ["a", "b"] and params.repetition_penalty == 1.2 and params.max_tokens == 3
    assert (params.presence_penalty, params.frequency_penalty) == (0.1, 0.2)


@pytest.mark.parametrize("num_predict", [-1, -2])
def test_ollama_unlimited_num_predict_takes_the_servers_bound(num_predict):
    api = Api(default_max_output_tokens=17)
    params = submitted_params(api, "/api/generate", {"model": "served", "prompt": "hi", "stream": False,
                                                     "options": {"num_predict": num_predict}})
    assert params.max_tokens == 17


def test_ollama_top_k_zero_keeps_every_token():
    params = submitted_params(Api(), "/api/chat", {**CHAT, "stream": False, "options": {"top_k": 0}})
    assert params.top_k == INT64_MAX  # the sampler keeps every token for any k beyond the vocabulary


def test_ollama_num_ctx_bounds_the_request_within_the_context():
    api = Api()  # a context of 200 tokens; CountingTokenizer: a token per character
    params = submitted_params(api, "/api/generate", {"model": "served", "prompt": "hello", "raw": True,
                                                     "stream": False, "options": {"num_ctx": 8}})
    assert params.max_tokens == 3  # 8 - the 5 prompt tokens
    unbounded = submitted_params(api, "/api/generate", {"model": "served", "prompt": "hello", "raw": True,
                                                        "stream": False})
    params = submitted_params(api, "/api/generate", {"model": "served", "prompt": "hello", "raw": True,
                                                     "stream": False, "options": {"num_ctx": 10**9}})
    assert params.max_tokens == unbounded.max_tokens == 200 - 5  # cut to the context, as without num_ctx


@pytest.mark.parametrize("answer_format, kind", [("json", "json_object"), (SCHEMA, "json_schema"), ("", None)])
def test_ollama_format_becomes_the_engines_grammar(answer_format, kind):
    params = submitted_params(Api(), "/api/chat", {**CHAT, "stream": False, "format": answer_format})
    assert (params.grammar.kind if params.grammar is not None else None) == kind


def test_ollama_format_holds_for_a_raw_prompt_too():
    params = submitted_params(Api(), "/api/generate", {"model": "served", "prompt": "hi", "raw": True,
                                                       "stream": False, "format": SCHEMA})
    assert params.grammar is not None and params.grammar.kind == "json_schema"


def test_anthropic_fields_become_the_engines_sampling_and_grammar():
    params = submitted_params(Api(), "/v1/messages", {**MESSAGE, "temperature": 0.3, "top_p": 0.8, "top_k": 5,
                                                      "stop_sequences": ["x", "y"], "output_config": {
                                                          "format": {"type": "json_schema", "schema": SCHEMA}}})
    assert (params.temperature, params.top_p, params.top_k, params.stop, params.max_tokens) == (0.3, 0.8, 5,
                                                                                               ["x", "y"], 5)
    assert params.grammar.kind == "json_schema"


def test_ollama_streams_unless_told_not_to_and_ends_a_failure_with_its_error():
    api = Api()
    status, headers, body = response(run(api.answered("/api/chat", CHAT, ["he", "llo"])))
    assert status == 200 and headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert "".join(line["message"]["content"] for line in lines) == "hello" and lines[-1]["message"]["content"] == ""
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True] and len(lines) >= 2
    assert lines[-1]["done_reason"] == "stop" and lines[-1]["eval_count"] == 2
    status, _, body = response(run(api.answered("/api/chat", CHAT, ["he"], error="boom")))
    last = json.loads(body.decode().splitlines()[-1])
    assert status == 200 and "boom" in last["error"]
    status, _, body = response(run(api.answered("/api/chat", {**CHAT, "stream": False}, ["he"], error="boom")))
    assert status == 500 and "boom" in json.loads(body)["error"]


def test_anthropic_streams_its_events_and_ends_a_failure_with_an_error_event():
    api = Api()
    status, headers, body = response(run(api.answered("/v1/messages", {**MESSAGE, "stream": True}, ["he", "llo"])))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    names = [line[7:] for line in body.decode().splitlines() if line.startswith("event: ")]
    assert names == [event["type"] for event in events]
    deltas = [event["delta"]["text"] for event in events if event["type"] == "content_block_delta"]
    assert "".join(deltas) == "hello"  # one delta per engine step, fewer when the writer comes late
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * len(deltas),
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "end_turn" and events[-2]["usage"]["output_tokens"] == 2
    status, _, body = response(run(api.answered("/v1/messages", {**MESSAGE, "stream": True}, ["he"], error="boom")))
    last = json.loads(body.decode().splitlines()[-2][6:])
    assert last["type"] == "error" and last["error"]["type"] == "api_error" and "boom" in last["error"]["message"]


def test_a_shutdown_ends_each_stream_in_its_apis_shape():
    async def scenario():
        api = Api()
        calls = [asyncio.create_task(api.call("POST", path, body)) for path, body in (
            ("/api/chat", CHAT), ("/v1/messages", {**MESSAGE, "stream": True}))]
        while len(api.engine.submissions) < 2:
            await asyncio.sleep(0.005)
        api.app.shut_down()
        return await asyncio.gather(*calls)

    ollama, anthropic = (response(peer)[2].decode() for peer in run(scenario()))
    assert json.loads(ollama.splitlines()[-1])["code"] == "server_shutdown"
    error = json.loads(anthropic.splitlines()[-2][6:])
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("path, shape", [("/api/tags", "ollama"), ("/api/chat", "ollama"),
                                         ("/v1/messages", "anthropic"), ("/v1/messages/count_tokens", "anthropic"),
                                         ("/tokenize", "openai"), ("/detokenize", "openai")])
def test_access_refusals_come_in_the_paths_error_shape(path, shape):
    api = Api(api_key=API_KEY)
    method = "GET" if path == "/api/tags" else "POST"
    status, _, body = response(run(api.call(method, path, {})))
    error = json.loads(body)
    assert status == 401
    if shape == "ollama":
        assert isinstance(error["error"], str) and error["code"] == "invalid_api_key"
    elif shape == "anthropic":
        assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
    else:
        assert error["error"]["code"] == "invalid_api_key"
    status, _, body = response(run(api.call(method, path, {}, headers={"x-api-key": API_KEY})))
    assert status != 401 and b"invalid_api_key" not in body  # past the access check, whatever the body says


def test_each_request_leaves_one_log_line(caplog):
    api = Api()
    with caplog.at_level(logging.INFO, logger="localserve.server.http_app"):
        run(api.answered("/api/chat", {**CHAT, "stream": False}, ["a", "b"]))
        run(api.call("GET", "/api/nope"))
    lines = [record.getMessage() for record in caplog.records if record.name == "localserve.server.http_app"]
    assert len(lines) == 2
    assert lines[0].startswith("POST /api/chat model=served status=200 tokens=2 in, 2 out ")
    assert lines[1].startswith("GET /api/nope model=- status=404 tokens=- ")


@pytest.mark.parametrize("headers, status", [({"Host": "evil.example"}, 403), ({"Origin": "http://evil.example"}, 403)])
def test_host_and_origin_are_checked_on_the_new_paths_too(headers, status):
    api = Api()
    shapes = {"/api/chat": lambda error: error["error"],
              "/v1/messages": lambda error: error["error"]["type"] == "permission_error",
              "/tokenize": lambda error: error["error"]["message"]}
    for path, read in shapes.items():
        got, _, body = response(run(api.call("POST", path, CHAT, headers=headers)))
        assert got == status and read(json.loads(body)), (path, body)
    assert api.engine.submissions == []


def test_a_top_k_that_is_off_is_written_as_each_api_writes_off():
    api = Api(sampling_defaults=SamplingDefaults(temperature=0.0))  # top_k None: off (the default model's)
    api.tokenizer.chat_template = ""  # the played tokenizer has no template
    status, _, body = response(run(api.call("POST", "/api/show", {"model": "served"})))
    assert status == 200 and json.loads(body)["parameters"].splitlines() == [
        "temperature 0", "top_p 1", "min_p 0", "num_ctx 200"]  # Ollama lists the parameters that are set
    status, _, body = response(run(api.call("GET", "/props")))
    assert status == 200 and json.loads(body)["default_generation_settings"]["params"]["top_k"] == 0  # llama.cpp's off
