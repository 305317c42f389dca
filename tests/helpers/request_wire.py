"""One generation request spelled in every wire format and sent over the real wire: `/v1/responses`
over HTTP and over the websocket, `/v1/chat/completions` and `/v1/completions`.

A case is a dict of the shared fields under their own names (`temperature`, `top_k`, `max_tokens`,
`logprobs`, `tools`, `structured_output`, ...; a value of None is sent as JSON null). `body_for`
spells a case as one format names its fields, and `Outcome.field` reads an error's `param` back into
the shared name. Tools, a named tool choice and a JSON schema format are written in a case as the
Responses API writes them (flat: `{"type": "function", "name": ...}`); chat completions nest them
(`{"type": "function", "function": {...}}`, `{"type": "json_schema", "json_schema": {...}}`). The
spellings are written here from the APIs' documentation, apart from the server's field maps: the tests
compare the server against this table, not against itself.

`RecordingEngineThread` is the engine thread these tests run the server on: it keeps the
`SamplingParams` of every submission and answers each at once (every sample ends, with no text), so
the server's whole path runs, hundreds of times a second, and the model never does.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from websockets.sync.client import connect

from localserve.engine.engine_thread import EngineThread
from localserve.engine.outputs import CompletionOutput, RequestOutput
from localserve.engine.sampling_params import SamplingParams

RESPONSES_HTTP, RESPONSES_WS, CHAT, COMPLETIONS = "responses-http", "responses-ws", "chat", "completions"
FORMATS = (RESPONSES_HTTP, RESPONSES_WS, CHAT, COMPLETIONS)
FAMILY = {RESPONSES_HTTP: "responses", RESPONSES_WS: "responses", CHAT: "chat", COMPLETIONS: "completions"}
PATHS = {RESPONSES_HTTP: "/v1/responses", CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
CLOSING_EVENTS = ("response.completed", "response.incomplete", "response.failed")

EXTRAS = ("top_k", "min_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _everywhere(name: str) -> dict[str, str]:
    return {"responses": name, "chat": name, "completions": name}


# shared field -> format family -> the dotted path of the field in that family's body (absent: no such field)
SPELLINGS: dict[str, dict[str, str]] = {
    "max_tokens": {"responses": "max_output_tokens", "chat": "max_tokens", "completions": "max_tokens"},
    "max_completion_tokens": {"chat": "max_completion_tokens"},  # chat's preferred spelling of max_tokens
    "temperature": _everywhere("temperature"),
    "top_p": _everywhere("top_p"),
    **{name: {"responses": f"localserve.{name}", "chat": name, "completions": name} for name in EXTRAS},
    "logprobs": {"responses": "top_logprobs", "chat": "top_logprobs", "completions": "logprobs"},
    "extension_logprobs": {"responses": "localserve.logprobs"},  # wins over top_logprobs
    "tools": {"responses": "tools", "chat": "tools"},
    "tool_choice": {"responses": "tool_choice", "chat": "tool_choice"},
    "structured_output": {"responses": "text.format", "chat": "response_format"},
    "reasoning_effort": {"responses": "reasoning.effort", "chat": "reasoning_effort"},
    "model": _everywhere("model"),
    "instructions": {"responses": "instructions"},
    "metadata": {"responses": "metadata"},
    "previous_response_id": {"responses": "previous_response_id"},
    "input_text": {"responses": "input", "chat": "messages", "completions": "prompt"},
    "input_items": {"responses": "input", "chat": "messages"},
}
# an error's param -> the shared field, where a format names it otherwise than its path
REPORTED = {"responses": {"reasoning": "reasoning_effort", "input": "input"},
            "chat": {"messages": "input", "max_completion_tokens": "max_tokens"}, "completions": {"prompt": "input"}}


def carries(fmt: str, case: dict[str, Any]) -> bool:
    """Whether the format has every field of the case."""
    return all(FAMILY[fmt] in SPELLINGS[name] for name in case if name in SPELLINGS)


def formats_carrying(case: dict[str, Any]) -> list[str]:
    return [fmt for fmt in FORMATS if carries(fmt, case)]


def _put(body: dict[str, Any], path: str, value: Any) -> None:
    *outer, last = path.split(".")
    for key in outer:
        body = body.setdefault(key, {})
    body[last] = value


def body_for(fmt: str, case: dict[str, Any]) -> dict[str, Any]:
    """The case as the format's request body; a field outside SPELLINGS is sent as it is (unknown ones)."""
    family = FAMILY[fmt]
    body: dict[str, Any] = {"type": "response.create"} if fmt == RESPONSES_WS else {}
    fields = {"input_text": "hello"} if "input_text" not in case and "input_items" not in case else {}
    for name, value in (fields | case).items():
        if name not in SPELLINGS:
            body[name] = value
        elif name == "input_text" and family != "completions":
            messages = [{"role": "user", "content": value}]
            _put(body, SPELLINGS[name][family], value if family == "responses" else messages)
        elif name == "input_items":
            _put(body, SPELLINGS[name][family], [{"role": "user", "content": text} for text in value])
        elif name in CHAT_NESTING and family == "chat":
            _put(body, SPELLINGS[name][family], CHAT_NESTING[name](value))
        elif name == "logprobs" and family == "chat" and value is not None:
            body.update(logprobs=True, top_logprobs=value)  # chat asks with a switch, then how many
        else:
            _put(body, SPELLINGS[name][family], value)
    return body


def _nested(value: Any, inner: str, kind: str) -> Any:
    """A flat object of type `kind` as chat completions nest it: its other keys inside `inner`."""
    if not isinstance(value, dict) or value.get("type") != kind:
        return value
    return {"type": kind, inner: {key: item for key, item in value.items() if key != "type"}}


CHAT_NESTING = {
    "tools": lambda tools: [_nested(tool, "function", "function") for tool in tools] if isinstance(tools, list)
    else tools,
    "tool_choice": lambda choice: _nested(choice, "function", "function"),
    "structured_output": lambda answer: _nested(answer, "json_schema", "json_schema"),
}
# chat completions' nested params as the flat ones read
CHAT_FLATTENED = [(re.compile(r"^(tools\[\d+\])\.function(?=\.|$)"), r"\1"),
                  (re.compile(r"^tool_choice\.function(?=\.|$)"), "tool_choice"),
                  (re.compile(r"^response_format\.json_schema(?=\.|$)"), "response_format")]


def shared_name(fmt: str, param: str | None) -> str | None:
    """The shared field an error's `param` names in this format (`stop[0]` for `localserve.stop[0]`)."""
    if param is None:
        return None
    family = FAMILY[fmt]
    if family == "chat":
        for pattern, flat in CHAT_FLATTENED:
            param = pattern.sub(flat, param)
    reverse = {spelled[family]: name for name, spelled in SPELLINGS.items() if family in spelled}
    reverse |= REPORTED[family]
    for wire, name in sorted(reverse.items(), key=lambda item: -len(item[0])):
        if param == wire or param.startswith((wire + "[", wire + ".")):
            return name + param[len(wire):]
    return param


@dataclass(frozen=True)
class Outcome:
    """What one format answered: the SamplingParams that reached the engine, or the refusal."""

    params: SamplingParams | None = None
    status: int | None = None
    code: str | None = None
    field: str | None = None  # the shared name of the field the error named
    response_id: str | None = dataclasses.field(default=None, compare=False)  # an accepted Responses request's

    @property
    def accepted(self) -> bool:
        return self.params is not None


class RecordingEngineThread(EngineThread):
    """Keeps each submission's SamplingParams (and prompt) and answers it at once: every sample stops with no
    text."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.submitted: list[SamplingParams] = []
        self.prompts: list[list[int]] = []

    def submit(self, prompt_token_ids, params, on_output, request_id=None):
        request_id = request_id or f"recorded-{len(self.submitted)}"
        self.submitted.append(params)
        self.prompts.append(list(prompt_token_ids))
        samples = [CompletionOutput(index, "", [], None, "stop") for index in range(params.n)]
        on_output(RequestOutput(request_id, list(prompt_token_ids), samples, True))
        return request_id


class WireClient:
    """Sends cases to one server in every format: HTTP over one keep-alive connection, the websocket mode
    over one connection; reads what reached the engine from its RecordingEngineThread."""

    def __init__(self, port: int, engine_thread: RecordingEngineThread) -> None:
        self.port, self.engine_thread = port, engine_thread
        self._http: http.client.HTTPConnection | None = None
        self._websocket = None
        self._connections = ExitStack()

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
        self._connections.close()

    def send(self, fmt: str, case: dict[str, Any]) -> Outcome:
        """Send the case in format `fmt`; the outcome, with the engine's side checked against it."""
        return self.send_body(fmt, body_for(fmt, case))

    def send_body(self, fmt: str, body: dict[str, Any]) -> Outcome:
        before = len(self.engine_thread.submitted)
        status, answer = self._websocket_answer(body) if fmt == RESPONSES_WS else self._http_answer(fmt, body)
        submitted = self.engine_thread.submitted[before:]
        if status == 200:
            assert len(submitted) == 1, (fmt, status, submitted)
            return Outcome(params=submitted[0], response_id=answer["id"])
        assert not submitted, (fmt, answer)
        assert answer["message"], (fmt, answer)
        return Outcome(status=status, code=answer["code"], field=shared_name(fmt, answer["param"]))

    def _http_answer(self, fmt: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The status and the answer (the response object, or an error's `error` object)."""
        data = json.dumps(body).encode()
        for attempt in range(2):  # an idle keep-alive connection the server closed: once more on a new one
            if self._http is None:
                self._http = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                self._http.request("POST", PATHS[fmt], data, {"Content-Type": "application/json"})
                response = self._http.getresponse()
                answer = json.loads(response.read())
                break
            except (http.client.RemoteDisconnected, ConnectionError):
                self._http.close()
                self._http = None
                if attempt:
                    raise
        if response.status == 200:
            assert answer.get("object") in ("response", "chat.completion", "text_completion"), answer
            return 200, answer
        return response.status, answer["error"]

    def _websocket_answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The status and the answer (the response object, or an error event's `error`)."""
        if self._websocket is None:
            self._websocket = self._connections.enter_context(connect(f"ws://127.0.0.1:{self.port}/v1/responses"))
        self._websocket.send(json.dumps(body))
        while True:
            event = json.loads(self._websocket.recv(timeout=30))
            if event["type"] == "error":
                return event["status"], event["error"]
            if event["type"] in CLOSING_EVENTS:
                return 200, event["response"]
