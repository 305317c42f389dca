"""Fields real clients send with a value that means "the default" or "no change", and the small endpoints they
probe first, each request as the client sends it.

Claude Code's first turn carries `output_config.effort` at Anthropic's default and `context_management` with
an edit that changes nothing here (earlier thinking is never rendered); Codex's Responses requests carry
`client_metadata` and no `max_output_tokens` (OpenAI sets no cap below the context), and its Ollama mode reads
`/api/version`; litellm's and aider's `ollama_chat/` ask `/api/show` with `name`; Claude Code probes `HEAD /`.
On the HTTP API as an ASGI app (tests/helpers/http_api.py) where no model is needed, else on the tiny model."""

from __future__ import annotations

import http.client
import json

import anthropic
import ollama
import pytest

from tests.helpers.http_api import Api, response, run
from tests.helpers.server import running_server

CLAUDE_CODE_TURN = {
    "model": "served", "max_tokens": 32, "stream": True, "temperature": 1,
    "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
    "metadata": {"user_id": "user_0f3a_account__session_9c1d"},
    "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
}
CODEX_METADATA = {"x-codex-installation-id": "3f1c0a9e-5b7d-4c2a-9e8f-0d1b2c3a4e5f",
                  "session_id": "019a0b1c-2d3e-7f40-8a9b-0c1d2e3f4a5b",
                  "thread_id": "019a0b1c-2d3e-7f40-8a9b-0c1d2e3f4a5b",
                  "x-codex-turn-metadata": '{"turn_id":"019a0b1c-2d3e-7f40-8a9b-0c1d2e3f4a5c","sandbox":"seatbelt"}'}


def test_claude_codes_first_turn_is_accepted():
    api = Api()
    peer = run(api.answered("/v1/messages", CLAUDE_CODE_TURN, ["hello"]))
    status, _, body = response(peer)
    assert status == 200, body
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "message_stop"


@pytest.mark.parametrize("field, value, param", [
    ("output_config", {"effort": "low"}, "output_config.effort"),  # less effort than the default would change it
    ("context_management", {"edits": [{"type": "clear_tool_uses_20250919"}]}, "context_management"),
    ("context_management", {"edits": [{"type": "compact_20260112"}]}, "context_management"),
])
def test_what_would_change_the_answer_is_still_refused_saying_why(field, value, param):
    api = Api()
    peer = run(api.call("POST", "/v1/messages", {**CLAUDE_CODE_TURN, "stream": False, field: value}))
    status, _, body = response(peer)
    error = json.loads(body)["error"]
    assert (status, error["code"], error["param"]) == (400, "unsupported_parameter", param), error
    assert "not supported" in error["message"]


def test_codex_client_metadata_is_kept_and_echoed():
    api = Api()
    peer = run(api.answered("/v1/responses", {"model": "served", "input": "hi", "client_metadata": CODEX_METADATA,
                                              "store": False}, ["hello"]))
    status, _, body = response(peer)
    assert status == 200, body
    assert json.loads(body)["client_metadata"] == CODEX_METADATA


@pytest.mark.parametrize("client_metadata, status", [
    ({f"k{index}": "v" for index in range(64)}, 200), ({f"k{index}": "v" for index in range(65)}, 400),
    ({"x-codex-turn-metadata": "x" * 8192}, 200), ({"x-codex-turn-metadata": "x" * 8193}, 400),
    ({"k" * 64: "v"}, 200), ({"k" * 65: "v"}, 400), ({"k": 5}, 400), ([], 400),
])  # each bound, and one past it
def test_client_metadata_bounds(client_metadata, status):
    api = Api()
    peer = run(api.answered("/v1/responses", {"model": "served", "input": "hi", "client_metadata": client_metadata},
                            ["hello"]))
    got, _, body = response(peer)
    assert got == status, body
    if status == 400:
        assert json.loads(body)["error"]["param"] == "client_metadata"


def test_responses_without_max_output_tokens_are_bounded_by_the_context_alone():
    api = Api(max_model_len=4096)  # a context above the 1,024 tokens the server once capped answers at
    run(api.answered("/v1/responses", {"model": "served", "input": "hi"}, ["hello"]))
    submission = api.engine.submissions[-1]
    assert submission.params.max_tokens == 4096 - len(submission.prompt_token_ids)


# ---------------------------------------------------------------------------------- on the tiny model
@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, model_alias="tiny-chat") as server:
        yield server


def request(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request(method, path, json.dumps(body) if body is not None else None)
    answer = connection.getresponse()
    status, headers, data = answer.status, {name.lower(): value for name, value in answer.getheaders()}, answer.read()
    connection.close()
    return status, headers, data


def test_the_ollama_version_is_the_one_whose_api_is_served(server):
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
    # Ollama 0.13.4 added /v1/responses, which this server serves: Codex's --oss asks for it
    assert client._request_raw("GET", "/api/version").json() == {"version": "0.13.4"}


def test_api_show_takes_name(server):
    status, _, body = request(server.port, "POST", "/api/show", {"name": "tiny-chat"})  # litellm's ollama_chat/
    assert status == 200, body
    ollama.ShowResponse.model_validate(json.loads(body))


@pytest.mark.parametrize("path", ["/", "/health", "/v1/models", "/api/tags", "/api/version", "/metrics"])
def test_head_answers_where_get_does(server, path):
    got_status, got_headers, _ = request(server.port, "GET", path)
    status, headers, body = request(server.port, "HEAD", path)
    assert (status, body) == (got_status, b"") and got_status == 200
    assert headers["content-type"] == got_headers["content-type"]


def test_head_is_not_allowed_where_get_is_not(server):
    status, _, body = request(server.port, "HEAD", "/v1/chat/completions")
    assert status == 405 and body == b""


def test_anthropic_sdk_sends_claude_codes_fields(server):
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0) as sdk:
        answer = sdk.beta.messages.create(
            model="tiny-chat", max_tokens=3, messages=[{"role": "user", "content": "hi"}],
            output_config={"effort": "high"},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    assert answer.stop_reason in ("end_turn", "max_tokens")
