"""Ollama's API as this server reads it: the field maps of `POST /api/chat` and `POST /api/generate`
(no I/O here), as Ollama's docs/api.md documents them.

Every field and every `options` key is honoured, ignored for a stated reason, or refused with
`unsupported_parameter` when honouring it would change the output and this server cannot; any other
is an `unknown_parameter`. Both endpoints stream unless `stream` is false. `num_predict` -1 and -2
(Ollama's "no limit" and "fill the context") take the server's default, `--max-tokens`: every answer
here has a bound. `num_ctx` bounds the request's prompt and output when it is smaller than the context
and is cut to the context when it is larger, as Ollama cuts it to what the model holds.
"""

from __future__ import annotations

import json
from typing import Any

from localserve.server.request import fields, tool_fields
from localserve.server.request.generation_request import OutputFormat, ReasoningChoice
from localserve.server.request.images import ImageSink, decode_base64
from localserve.server.request.keep_alive import KeepAlive
from localserve.server.request.messages import MessageFormat
from localserve.server.request.sampling_rules import INT64_MAX
from localserve.server.request.validation import ProtocolError, check_value, shown

NO_LIMIT = (-1, -2)  # num_predict: Ollama's unlimited and fill-the-context
THINK_LEVELS = ("low", "medium", "high")  # `think` as a string (gpt-oss); true thinks at the template's default
# Ollama's messages once their calls carry ids (chat completions' shape): what the shared parser reads
OLLAMA_MESSAGES = MessageFormat(text_parts=(), unused_text_fields=("tool_name",), tool_turns="chat",
                                message_images=True, reasoning_fields=("thinking",))
HARDWARE = "set when the server starts (see localserve serve --help)"


class NumPredict(fields.Field):
    """`options.num_predict`: the shared `max_tokens`; -1 and -2 leave it to the server."""

    shared = "max_tokens"

    def rank(self) -> tuple[int, int]:
        return fields.Sampling("max_tokens").rank()

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        if check_value(value, int, param) not in NO_LIMIT:
            fields.Sampling("max_tokens").apply(value, param, draft)


class AnswerFormat(fields.Field):
    """`format`: "json" (any JSON object) or a JSON schema the answer must match; "" is plain text. A schema
    keyword the engine cannot enforce is ignored, as Ollama's own grammars ignore what they cannot express."""

    shared = "output_format"

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        value = check_value(value, (str, dict), param)
        if value == "":
            return
        if isinstance(value, str):
            if value != "json":
                raise ProtocolError("invalid_value", f"'{param}' must be \"json\" or a JSON schema, got {shown(value)}",
                                    param)
            draft.set("output_format", OutputFormat("json_object"), param)
            return
        draft.set("output_format", tool_fields.schema_format(value, param, False), param)


class TopK(fields.Field):
    """`options.top_k`: the shared `top_k`; 0 or less keeps every token (llama.cpp's and so Ollama's "off")."""

    shared = "top_k"

    def rank(self) -> tuple[int, int]:
        return fields.Sampling("top_k").rank()

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        if check_value(value, int, param) <= 0:
            value = INT64_MAX  # beyond any vocabulary: the filter keeps every token
        fields.Sampling("top_k").apply(value, param, draft)


def _with_call_ids(messages: list[Any], param: str) -> list[Any]:
    """`messages`, with Ollama's tool turns: an assistant's `tool_calls` are `{"function": {"name", "arguments":
    {...}}}` with no id, and a `tool` message names the function it answers (`tool_name`) rather than a call.
    Each call is given an id here and each result the id of the earliest unanswered call of its function (of
    any function without `tool_name`), so the conversation reads as chat completions spell it. An assistant's
    `thinking` stays: its reasoning (OLLAMA_MESSAGES' reasoning field)."""
    unanswered: list[tuple[str, str]] = []  # (call id, function name), oldest first
    spelled = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            spelled.append(message)
            continue
        message = dict(message)
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message["tool_calls"] = [_call(call, f"{param}[{index}].tool_calls[{number}]", f"call_{index}_{number}")
                                     for number, call in enumerate(calls)]
            unanswered += [(call["id"], call["function"]["name"]) for call in message["tool_calls"]]
        elif message.get("role") == "tool":
            name = message.get("tool_name")
            match = next((pair for pair in unanswered if name is None or pair[1] == name), None)
            if match is None:
                where = f"{param}[{index}]"
                raise ProtocolError("invalid_value", f"'{where}': the tool result answers no earlier call"
                                    + (f" of {name!r}" if isinstance(name, str) else ""), where)
            unanswered.remove(match)
            message["tool_call_id"] = match[0]
        spelled.append(message)
    return spelled


def _call(call: Any, where: str, call_id: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ProtocolError("invalid_type", f"'{where}' must be a call: {{\"function\": {{\"name\", \"arguments\"}}}}",
                            where)
    arguments = function.get("arguments", {})
    if not isinstance(arguments, (dict, str)):  # text: the unfinished call an older answer of this server held
        raise ProtocolError("invalid_type", f"'{where}.function.arguments' must be an object",
                            f"{where}.function.arguments")
    return {"id": call_id, "type": "function", "function": {
        "name": function.get("name"), "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


class Think(fields.Field):
    """`think`: true or false (thinking on or off, where the template can switch it), or a level (low, medium,
    high) for the templates that take one."""

    shared = "reasoning"

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        value = check_value(value, (bool, str), param)
        if isinstance(value, str) and value not in THINK_LEVELS:
            raise ProtocolError("invalid_value", f"'{param}' must be true, false or one of "
                                f"{', '.join(THINK_LEVELS)}, got {shown(value)}", param)
        effort = value if isinstance(value, str) else "medium" if value else "none"
        draft.set("reasoning", ReasoningChoice(effort), param)


class GeneratePrompt(fields.Field):
    """`/api/generate`'s `prompt`: one user message (the raw text itself with `raw`); empty: nothing to say."""

    stage = fields.Stage.INPUT
    shared = "input"

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        if check_value(value, str, param):
            draft.set("input_messages", [{"role": "user", "content": value}], param)


class GenerateImages(fields.Field):
    """`/api/generate`'s `images`: base64 files, placed before the prompt (a prompt of none is an empty one)."""

    stage = fields.Stage.INPUT

    def rank(self) -> tuple[int, int]:
        return (self.stage, 1)  # after the prompt

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        files = check_value(value, list, param)
        if not files:
            return
        sink = ImageSink(draft.limits.images)
        for number, text in enumerate(files):
            at = f"{param}[{number}]"
            sink.reserve(at)
            sink.place(decode_base64(text, at, sink.bounds), at, 0, 0)
        if not draft.values.get("input_messages"):
            draft.set("input_messages", [{"role": "user", "content": ""}], param)
        draft.values["images"] = tuple(sink.placed)


class Raw(fields.Field):
    """`raw: true`: the prompt is tokenized as it is, with no chat template (and so no `system`)."""

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        if not check_value(value, bool, param):
            return
        if draft.values.get("instructions"):
            raise ProtocolError("unsupported_parameter", "'system' is not supported with 'raw': true: a raw "
                                "prompt has no template to put it in; write it into the prompt", "system")
        messages = draft.values.pop("input_messages", [])
        if messages:  # an empty raw prompt still only asks that the model be loaded
            draft.set("prompt", messages[0]["content"], draft.names["input_messages"])


OPTIONS = fields.Nested({
    "num_predict": NumPredict(),
    "temperature": fields.Sampling("temperature"),
    "top_k": TopK(),
    "top_p": fields.Sampling("top_p"),
    "min_p": fields.Sampling("min_p"),
    "seed": fields.Sampling("seed"),
    "stop": fields.Sampling("stop"),
    "repeat_penalty": fields.Sampling("repetition_penalty"),
    "presence_penalty": fields.Sampling("presence_penalty"),
    "frequency_penalty": fields.Sampling("frequency_penalty"),
    "num_ctx": fields.ContextWindow(),
    "repeat_last_n": fields.Refused("the repetition penalty reads the whole prompt and output (-1)",
                                    fields.one_of(-1), int),
    "typical_p": fields.Refused("locally typical sampling is not applied (1.0 is off)", fields.one_of(1), float),
    "tfs_z": fields.Refused("tail-free sampling is not applied (1.0 is off)", fields.one_of(1), float),
    "mirostat": fields.Refused("Mirostat sampling is not applied (0 is off)", fields.one_of(0), int),
    "mirostat_tau": fields.Ignored("it is read only by Mirostat, which is off", float),
    "mirostat_eta": fields.Ignored("it is read only by Mirostat, which is off", float),
    "penalize_newline": fields.Ignored("Ollama no longer reads it either", bool),
    "num_keep": fields.Ignored("a prompt is never cut here, so no tokens need keeping", int),
    **{name: fields.Ignored(HARDWARE) for name in ("num_batch", "num_gpu", "main_gpu", "low_vram", "vocab_only",
                                                   "use_mmap", "use_mlock", "num_thread", "numa", "f16_kv")},
})

COMMON: dict[str, fields.Field] = {
    "model": fields.Required(fields.Text("model", bounded=True)),
    "options": OPTIONS,
    "stream": fields.Flag("stream"),
    "format": AnswerFormat(),
    "think": Think(),
    "keep_alive": KeepAlive(),
}

OLLAMA_CHAT = fields.WireFormat({
    "messages": fields.Messages(OLLAMA_MESSAGES, _with_call_ids),
    **COMMON,
    "tools": tool_fields.Tools(),
}, stores=False, streams=True)

OLLAMA_GENERATE = fields.WireFormat({
    "prompt": GeneratePrompt(),
    **COMMON,
    "system": fields.Text("instructions"),
    "raw": Raw(),
    "suffix": fields.Refused("there is no fill-in-the-middle", kind=str),
    "images": GenerateImages(),
    "template": fields.Refused("the model's own chat template is used; send a rendered prompt with raw: true",
                               kind=str),
    "context": fields.Refused("no context is handed out; send the conversation to /api/chat instead", kind=list),
}, stores=False, streams=True)
