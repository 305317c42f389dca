"""A conversation's messages as each API spells them, checked into {"role", "content"} (no I/O here).

`MessageFormat` says what one API's messages may hold (content part types, a bare string, item
types, roles and fields it cannot honour, how it spells tool turns); `parse_messages` is the one parser
of them all. Tool turns become chat completions' shape whatever the API (request_model.Message):
an assistant message's `tool_calls` (each with its `id` and its arguments as JSON text), a `tool`
message's `tool_call_id`. Chat completions write them so; the Responses API writes `function_call` items
(joined into the assistant message before them) and `function_call_output` items (which may name the
function instead of the call: `tool_call_id` None and its `name`, resolved against the whole conversation by
server/generation/chat_turns.py). A call whose arguments are no JSON object (one cut short, as an older answer
may hold) is the model's own text (request_model.UNFINISHED_CALL_IDS), never a refusal.

An assistant turn's reasoning, as the client resends it (chat completions' `reasoning_content` or
`reasoning`, Ollama's `thinking`, Anthropic's `thinking` blocks, the Responses API's `reasoning` items'
`reasoning_text` before the turn they belong to), becomes the message's `reasoning_content`
(REASONING_KEY), which the chat templates that render reasoning read (Qwen3, Qwen3.5 / 3.6, Gemma 4: in a
tool loop, the turns after the last user message keep their reasoning, as the model wrote it); the others
ignore it. Reasoning of an assistant turn given no text is nothing.

Image parts (a format's `image_parts`: a reader of the part's file and declared media type) and Ollama's
`images` list on a message (`message_images`) are decoded into an `ImageSink` (server/request/images.py),
each placed at its message and at the character of the message's text it stands before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from localserve.server.request.generation_request import UNFINISHED_CALL_IDS, Message, RequestLimits, is_json_object
from localserve.server.request.images import ImageBounds, ImageSink, decode_base64
from localserve.server.request.validation import ProtocolError, check_length, check_type, shown

# a part's file and its declared media type (None: none declared), read from the part at `where`
ImagePartReader = Callable[[dict[str, Any], str, ImageBounds], tuple[bytes, str | None]]
# a part's path in the request as sent, kept in the part when a respelling moved it (Anthropic's image blocks)
PART_PATH = "localserve_path"
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
REASONING_KEY = "reasoning_content"  # an assistant message's reasoning, as the chat templates read it


@dataclass(frozen=True)
class MessageFormat:
    """How one API spells a conversation's messages."""

    text_parts: tuple[str, ...]  # the content part types that carry text
    bare_string: bool = False  # a string is one user message
    at_least_one: bool = False
    item_types: tuple[str, ...] = ()  # the `type` an item may name (the first when it names none)
    refused_roles: Mapping[str, str] = field(default_factory=dict)  # role -> why it is not supported
    refused_fields: tuple[str, ...] = ()  # message fields that would need more than text
    unused_text_fields: tuple[str, ...] = ()  # strings accepted and not used (a participant's name)
    null_assistant_content: bool = False  # an assistant message's content may be null
    tool_turns: Literal["chat", "responses"] | None = None  # how the API spells calls and results (None: no tools)
    image_parts: Mapping[str, ImagePartReader] = field(default_factory=dict)  # part type -> its reader
    message_images: bool = False  # a message's `images`: base64 files before its text (Ollama's)
    reasoning_fields: tuple[str, ...] = ()  # an assistant message's fields holding its reasoning (the first set)


@dataclass(frozen=True)
class _Placing:
    """Where a message's images go: the request's sink, and the message's index in the parsed list."""

    sink: ImageSink
    message: int


def parse_messages(value: Any, param: str, form: MessageFormat, limits: RequestLimits,
                   images: ImageSink | None = None) -> list[Message]:
    """The messages of `value`, checked, as {"role", "content"} with the roles user/assistant/system; their
    images decoded into `images` (a sink of its own when None)."""
    sink = images if images is not None else ImageSink(limits.images)
    if form.bare_string and isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ProtocolError("invalid_type", f"'{param}' must be {'a string or ' if form.bare_string else ''}an "
                            "array of messages", param)
    if form.at_least_one and not value:
        raise ProtocolError("invalid_value", f"'{param}' must hold at least one message", param)
    check_length(value, param, limits.max_input_items)
    messages: list[Message] = []
    reasoning = ""  # a `reasoning` item's text, for the assistant turn after it
    for index, item in enumerate(value):
        where = f"{param}[{index}]"
        kind = item.get("type") if form.tool_turns == "responses" and isinstance(item, dict) else None
        if kind == "reasoning":
            reasoning += _reasoning_item_text(item, where)
            continue
        if kind == "function_call":
            call = _call(item, where, "call_id", item.get("name"), item.get("arguments"), f"{where}.")
            if not messages or messages[-1]["role"] != "assistant" or reasoning:
                messages.append({"role": "assistant", "content": ""})
            _join_call(messages[-1], call)
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "".join(_part_text(part, f"{where}.output[{number}]", form, images=False)
                                 for number, part in enumerate(output))
            if not isinstance(output, str):
                raise ProtocolError("invalid_type", f"'{where}.output' must be a string or text parts",
                                    f"{where}.output")
            messages.append(_function_output(item, where, output))
        else:
            messages.append(_message(item, where, form, _Placing(sink, len(messages))))
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1][REASONING_KEY] = reasoning
        reasoning = ""  # reasoning with no assistant turn after it belongs to none
    return messages


def _reasoning_item_text(item: Mapping[str, Any], where: str) -> str:
    """A Responses `reasoning` item's reasoning: the text of its `reasoning_text` parts (its summary is a
    summary, not what the model wrote; encrypted content cannot be read here)."""
    content = item.get("content")
    if content is None:
        return ""
    if not isinstance(content, list):
        raise ProtocolError("invalid_type", f"'{where}.content' must be an array of reasoning_text parts",
                            f"{where}.content")
    texts = []
    for number, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text":
            raise ProtocolError("invalid_type", f"'{where}.content[{number}]' must be a reasoning_text part",
                                f"{where}.content[{number}]")
        texts.append(check_type(part, "text", str, f"{where}.content[{number}].text") or "")
    return "".join(texts)


def _function_output(item: Mapping[str, Any], where: str, output: str) -> Message:
    """A `function_call_output` as a tool message: for the call of its `call_id`, or, without one (optional in
    the SDK's types), for the earliest unanswered call of the function it names (resolved later)."""
    if item.get("call_id") is None and isinstance(item.get("name"), str) and item["name"]:
        return {"role": "tool", "content": output, "tool_call_id": None, "name": item["name"]}
    return {"role": "tool", "content": output, "tool_call_id": _call_id(item, "call_id", f"{where}.call_id")}


def _join_call(message: Message, call: dict[str, Any]) -> None:
    """Join `call` to the assistant `message`: as one of its calls, or, when its arguments are no JSON object (a
    call cut short), as the model's own text after its content."""
    arguments = call["function"]["arguments"]
    if not arguments.strip() or is_json_object(arguments):
        message.setdefault("tool_calls", []).append(call)
        return
    message["content"] = "\n".join(text for text in (message["content"], arguments) if text)
    message.setdefault(UNFINISHED_CALL_IDS, []).append(call["id"])


def _call_id(item: Mapping[str, Any], key: str, where: str) -> str:
    call_id = item.get(key)
    if not isinstance(call_id, str) or not call_id:
        raise ProtocolError("invalid_type", f"'{where}' must be the call's id (a non-empty string)", where)
    return call_id


def _call(item: Mapping[str, Any], where: str, id_key: str, name: Any, arguments: Any, prefix: str) -> dict[str, Any]:
    """One call of an assistant turn as chat completions spell it; `prefix` is where its name and arguments are."""
    if not isinstance(name, str) or not name:
        raise ProtocolError("invalid_type", f"'{prefix}name' must be the function's name", f"{prefix}name")
    if not isinstance(arguments, str):
        raise ProtocolError("invalid_type", f"'{prefix}arguments' must be the arguments as JSON text",
                            f"{prefix}arguments")
    return {"id": _call_id(item, id_key, f"{where}.{id_key}"), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _message(item: Any, where: str, form: MessageFormat, placing: _Placing) -> Message:
    if not isinstance(item, dict):
        raise ProtocolError("invalid_type", f"'{where}' must be a message object", where)
    if form.item_types:
        kind = check_type(item, "type", str, f"{where}.type") or form.item_types[0]
        if kind not in form.item_types:
            raise ProtocolError("unsupported_value", f"'{where}.type' {shown(kind)} is not supported: this "
                                "server takes messages (of text and images) only", f"{where}.type")
    role = check_type(item, "role", str, f"{where}.role")
    if role == "tool" and form.tool_turns == "chat":
        content = _content(item, where, form, placing)
        return {"role": "tool", "content": content, "tool_call_id": _call_id(item, "tool_call_id",
                                                                              f"{where}.tool_call_id")}
    if role in form.refused_roles:
        raise ProtocolError("unsupported_value", f"'{where}.role' {role!r} is not supported: "
                            f"{form.refused_roles[role]}", f"{where}.role")
    if role not in ROLES:
        raise ProtocolError("invalid_value", f"'{where}.role' must be one of {sorted(ROLES)}, got {shown(role)}",
                            f"{where}.role")
    for name in form.refused_fields:
        if item.get(name):
            raise ProtocolError("unsupported_value", f"'{where}.{name}' is not supported: this server takes "
                                "text messages only", f"{where}.{name}")
    for name in form.unused_text_fields:
        check_type(item, name, str, f"{where}.{name}")
    if form.message_images:
        _message_images(item, where, placing)
    calls = item.get("tool_calls") if form.tool_turns == "chat" and role == "assistant" else None
    if calls is not None:
        if not isinstance(calls, list):
            raise ProtocolError("invalid_type", f"'{where}.tool_calls' must be an array of calls",
                                f"{where}.tool_calls")
        message = {"role": "assistant", "content": _content(item, where, form, placing, null_allowed=True)}
        for number, call in enumerate(calls):
            _join_call(message, _chat_call(call, f"{where}.tool_calls[{number}]"))
        return _with_reasoning(message, item, where, form)
    content = _content(item, where, form, placing, null_allowed=role == "assistant" and form.null_assistant_content)
    message = {"role": ROLES[role], "content": content}
    return _with_reasoning(message, item, where, form) if role == "assistant" else message


def _with_reasoning(message: Message, item: Mapping[str, Any], where: str, form: MessageFormat) -> Message:
    """The assistant `message` with the reasoning the client resent in the first of the format's reasoning
    fields that holds some (module doc)."""
    for name in form.reasoning_fields:
        text = check_type(item, name, str, f"{where}.{name}")
        if text:
            message[REASONING_KEY] = text
            break
    return message


def _chat_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(
            call.get("function"), dict):
        raise ProtocolError("invalid_type", f"'{where}' must be a function call ({{\"id\", \"type\": \"function\", "
                            f"\"function\": {{\"name\", \"arguments\"}}}})", where)
    function = call["function"]
    return _call(call, where, "id", function.get("name"), function.get("arguments"), f"{where}.function.")


def _message_images(item: Mapping[str, Any], where: str, placing: _Placing) -> None:
    """A message's `images` (base64 files), placed before its text."""
    files = item.get("images")
    if files is None:
        return
    if not isinstance(files, list):
        raise ProtocolError("invalid_type", f"'{where}.images' must be an array of base64 images", f"{where}.images")
    for number, text in enumerate(files):
        at = f"{where}.images[{number}]"
        placing.sink.reserve(at)
        placing.sink.place(decode_base64(text, at, placing.sink.bounds), at, placing.message, 0)


def _content(item: Mapping[str, Any], where: str, form: MessageFormat, placing: _Placing,
             null_allowed: bool = False) -> str:
    content = item.get("content")
    if isinstance(content, list):
        texts: list[str] = []
        offset = 0
        for index, part in enumerate(content):
            at = f"{where}.content[{index}]"
            reader = form.image_parts.get(part.get("type")) if isinstance(part, dict) else None
            if reader is None:
                texts.append(_part_text(part, at, form))
                offset += len(texts[-1])
                continue
            at = part.get(PART_PATH, at)
            placing.sink.reserve(at)
            data, media_type = reader(part, at, placing.sink.bounds)
            placing.sink.place(data, at, placing.message, offset, media_type)
        content = "".join(texts)
    if content is None and null_allowed:
        content = ""
    if not isinstance(content, str):
        kinds = "text or image parts" if form.image_parts else "text parts"
        raise ProtocolError("invalid_type", f"'{where}.content' must be a string or an array of {kinds}",
                            f"{where}.content")
    return content


def _part_text(part: Any, where: str, form: MessageFormat, images: bool = True) -> str:
    if not isinstance(part, dict) or part.get("type") not in form.text_parts:
        image_parts = tuple(form.image_parts) if images else ()
        kinds = " or ".join(repr(kind) for kind in (*form.text_parts, *image_parts))
        what = "a text or image part" if image_parts else "a text part"
        raise ProtocolError("unsupported_value", f"'{where}' must be {what} (type {kinds})", where)
    return check_type(part, "text", str, f"{where}.text") or ""
