"""The pieces every wire format's request is made of, and the one parser that reads a body through a
format's field map into a `GenerationRequest` (no I/O here).

A `WireFormat` says, for each field of one API, what it means: a shared sampling field (`Sampling`;
its type and bounds are in server/request/sampling_rules.py alone), the input (`Messages` in a
`MessageFormat` of server/request/messages.py, or a `Prompt`), an identifier (`Text`), an output
option (`Flag`, `Include`, `Metadata`), tools, a tool choice, an answer's format or a reasoning effort
(server/request/tool_fields.py), an object of more fields (`Nested`), a field accepted and
ignored for a stated reason (`Ignored`), or a field the API carries and this server does not honour
(`Refused`: `unsupported_parameter` as soon as its value would change the output). A field the map
lacks is an `unknown_parameter`. A new API is a new map.

`parse_request` checks the fields in one order whatever the format (unknown names, refusals, the
input, identifiers, sampling in `SAMPLING_RULES`' order, the rest), so the same values get the same
answer on every format, and an error names the field as that format spells it (`param`).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from localserve.server.request.generation_request import (
    GenerationRequest,
    ReasoningChoice,
    RequestLimits,
    SamplingChoice,
)
from localserve.server.request.images import ImageSink
from localserve.server.request.messages import MessageFormat, parse_messages
from localserve.server.request.sampling_rules import SAMPLING_ORDER, SAMPLING_RULES
from localserve.server.request.validation import ProtocolError, check_length, check_range, check_value, shown
from localserve.tokenizer.tools import AUTO, ChatFormatError

JsonType = type | tuple[type, ...]


class Stage(enum.IntEnum):
    """The order fields are checked in, on every format."""

    REFUSAL = 0
    INPUT = 1
    IDENTIFIER = 2
    SAMPLING = 3
    OUTPUT = 4


# ---------------------------------------------------------------------------------- what a field means
@dataclass
class RequestDraft:
    """The request as its fields are checked: values by shared name, and which wire field gave each."""

    limits: RequestLimits
    values: dict[str, Any] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # shared field -> the wire field that set it
    preferred: set[str] = field(default_factory=set)  # shared fields set by their preferred spelling
    needs_switch: str | None = None  # a wire field that counts log-probabilities only with the switch on

    def set(self, name: str, value: Any, param: str, preferred: bool = False) -> None:
        if name in self.preferred and not preferred:
            return
        self.values[name], self.names[name] = value, param
        if preferred:
            self.preferred.add(name)


class Field:
    """What one wire field means; `apply` checks its value (not null) into the draft."""

    stage: ClassVar[Stage] = Stage.OUTPUT
    required: ClassVar[bool] = False
    shared: str | None = None  # the shared field it carries, when errors found later may name it

    def rank(self) -> tuple[int, int]:
        return (self.stage, 0)

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Sampling(Field):
    """A shared sampling field (its rule: SAMPLING_RULES[name])."""

    name: str
    preferred: bool = False  # wins over another spelling of the same field in the same request
    needs_switch: bool = False  # counts log-probabilities only with the format's switch on
    stage = Stage.SAMPLING

    @property
    def shared(self) -> str:
        return self.name

    def rank(self) -> tuple[int, int]:
        return (self.stage, SAMPLING_ORDER.index(self.name))

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        draft.set(self.name, SAMPLING_RULES[self.name].check(value, param, draft.limits), param, self.preferred)
        if self.needs_switch:
            draft.needs_switch = param


@dataclass(frozen=True)
class Messages(Field):
    """The conversation's input messages (required); `respell` first turns an API's own spelling of a list of
    them into chat completions' (Ollama's and Anthropic's tool turns), the list's length checked before."""

    form: MessageFormat
    respell: Callable[[list[Any], str], list[Any]] | None = None
    stage = Stage.INPUT
    required = True
    shared = "input"

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        if self.respell is not None and isinstance(value, list):
            check_length(value, param, draft.limits.max_input_items)
            value = self.respell(value, param)
        sink = ImageSink(draft.limits.images)
        draft.set("input_messages", parse_messages(value, param, self.form, draft.limits, sink), param)
        draft.values["images"] = tuple(sink.placed)


@dataclass(frozen=True)
class Prompt(Field):
    """Text tokenized as it is, no chat template (required): a string, or an array of one string."""

    stage = Stage.INPUT
    required = True
    shared = "input"

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]  # a batch of one
        if not isinstance(value, str):
            raise ProtocolError("unsupported_value", f"'{param}' must be a string (or an array of one string): "
                                "batches and token arrays are not supported", param)
        draft.set("prompt", value, param)


@dataclass(frozen=True)
class Text(Field):
    """A string field of the request: `instructions`, `model`, `previous_response_id`."""

    name: str
    bounded: bool = False  # an identifier: at most RequestLimits.max_id_chars
    preferred: bool = False  # wins over another spelling of the same field in the same request
    stage = Stage.IDENTIFIER

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        value = check_value(value, str, param)
        if self.bounded:
            check_length(value, param, draft.limits.max_id_chars)
        draft.set(self.name, value, param, self.preferred)


@dataclass(frozen=True)
class Required(Field):
    """`inner`, and the request must carry it (`missing_required_parameter` without it)."""

    inner: Field
    required = True

    @property
    def shared(self) -> str | None:
        return self.inner.shared

    def rank(self) -> tuple[int, int]:
        return self.inner.rank()

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        self.inner.apply(value, param, draft)


@dataclass(frozen=True)
class ContextWindow(Field):
    """The tokens of prompt and output this request may take (>= 1): a window smaller than the context
    bounds it; a larger one is cut to the context (as Ollama cuts `num_ctx` to what the model holds)."""

    shared = "context_tokens"

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        value = check_value(value, int, param)
        check_range(value, param, 1, float("inf"), integer=True)
        draft.set("context_tokens", value, param)


@dataclass(frozen=True)
class Flag(Field):
    """A boolean of the request: `store`, `generate`, `stream`, `include_usage`."""

    name: str

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        draft.set(self.name, check_value(value, bool, param), param)


@dataclass(frozen=True)
class Setting(Field):
    """A field of an endpoint that does not generate (`/tokenize`'s `with_pieces`): of JSON type `kind`,
    kept under its name in `GenerationRequest.settings` for the endpoint to read."""

    kind: JsonType

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        draft.values.setdefault("settings", {})[param] = check_value(value, self.kind, param)


@dataclass(frozen=True)
class Prewarm(Field):
    """True: only prefill the input, as `generate: false` (it wins over `generate`, as in OpenAI's API)."""

    def rank(self) -> tuple[int, int]:
        return (self.stage, 1)  # after every other output field: after `generate`

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        if check_value(value, bool, param):
            draft.set("generate", False, param)


@dataclass(frozen=True)
class LogprobsSwitch(Field):
    """A boolean that turns log-probabilities on (with no count: no alternatives)."""

    shared = "logprobs_switch"

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        draft.set("logprobs_switch", check_value(value, bool, param), param)


@dataclass(frozen=True)
class Include(Field):
    """An array of strings naming more output; holding `logprobs_item` turns log-probabilities on."""

    logprobs_item: str

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        value = check_value(value, list, param)
        if not all(isinstance(name, str) for name in value):
            raise ProtocolError("invalid_type", f"'{param}' must be an array of strings", param)
        if self.logprobs_item in value:
            draft.set("logprobs_switch", True, param)


@dataclass(frozen=True)
class Metadata(Field):
    """String keys to string values, bounded in number and length, echoed: the response's `metadata`, or (`client`)
    a client's own tags (Codex's `client_metadata`: its session, thread and turn), kept only to be echoed and
    bounded more loosely (a turn's tags are JSON text)."""

    client: bool = False

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        metadata, limits = check_value(value, dict, param), draft.limits
        max_keys, max_value_chars = ((limits.max_client_metadata_keys, limits.max_client_metadata_value_chars)
                                     if self.client else (limits.max_metadata_keys, limits.max_metadata_value_chars))
        if len(metadata) > max_keys or not all(
                isinstance(text, str) and len(key) <= limits.max_metadata_key_chars
                and len(text) <= max_value_chars for key, text in metadata.items()):
            raise ProtocolError("invalid_value", f"'{param}' must map at most {max_keys} strings "
                                f"(keys up to {limits.max_metadata_key_chars} characters) to strings (up to "
                                f"{max_value_chars} characters)", param)
        if not self.client:
            draft.set("metadata", metadata, param)


@dataclass(frozen=True)
class Ignored(Field):
    """Accepted, and changes nothing here (`why`); of JSON type `kind` when given (it is echoed)."""

    why: str
    kind: JsonType | None = None

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        if self.kind is not None:
            check_value(value, self.kind, param)


def is_empty(value: Any) -> bool:
    return not value


def one_of(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value in allowed


def plain_text(response_format: dict[str, Any]) -> bool:
    return response_format.get("type", "text") == "text"


FORMAT_OWN = 99  # the rank of a format's own refusals: after the shared ones


@dataclass(frozen=True)
class Refused(Field):
    """A field the API carries and this server cannot honour: any value but those `allows` accepts
    (the ones that change nothing) is `unsupported_parameter`, naming the field and saying `why`.
    Refusals are checked in `order`: the shared ones (below) first, in the same order on every format."""

    why: str | Callable[[Any], str]  # a callable tells why from the refused value
    allows: Callable[[Any], bool] = is_empty
    kind: JsonType | None = None
    order: int = FORMAT_OWN
    stage = Stage.REFUSAL

    def rank(self) -> tuple[int, int]:
        return (self.stage, self.order)

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        if self.kind is not None:
            value = check_value(value, self.kind, param)
        if not self.allows(value):
            why = self.why(value) if callable(self.why) else self.why
            raise ProtocolError("unsupported_parameter", f"'{param}' is not supported: {why}", param)


@dataclass(frozen=True)
class Nested(Field):
    """An object whose keys are fields too; `open`: keys it does not name change nothing (the API has
    more of them than this server reads), else they are unknown parameters."""

    fields: Mapping[str, Field]
    open: bool = False


# ---------------------------------------------------------------------------------- formats and the parser
@dataclass(frozen=True)
class WireFormat:
    """One API's generation request: the meaning of each of its fields (its field map)."""

    fields: Mapping[str, Field]
    default_max_tokens: int | None = None  # None: the server's (ServerConfig.default_max_output_tokens)
    streams: bool = False  # whether a request that does not say `stream` is streamed (Ollama's are)
    stores: bool = True  # False: no answer is kept for previous_response_id beyond its own request
    echoed: Mapping[str, Any] = field(default_factory=dict)  # fields the answer echoes, and their defaults
    echoed_if_sent: tuple[str, ...] = ()  # fields the answer echoes when the request sent them
    wire_names: Mapping[str, str] = field(init=False)  # shared field -> its first spelling in the map

    def __post_init__(self) -> None:
        names: dict[str, str] = {}
        pending = [("", self.fields)]
        while pending:
            prefix, fields = pending.pop(0)
            for key, meaning in fields.items():
                if isinstance(meaning, Nested):
                    pending.append((f"{prefix}{key}.", meaning.fields))
                elif meaning.shared is not None:
                    names.setdefault(meaning.shared, prefix + key)
        object.__setattr__(self, "wire_names", names)


def parse_request(body: Mapping[str, Any], wire: WireFormat, limits: RequestLimits) -> GenerationRequest:
    """Check every field of `body` by `wire`'s field map into a GenerationRequest (raises ProtocolError)."""
    present: list[tuple[str, Field, Any]] = []
    _collect(body, wire.fields, "", present, is_open=False)
    draft = RequestDraft(limits)
    for param, meaning, value in sorted(present, key=lambda item: item[1].rank()):
        if value is None:
            raise ProtocolError("missing_required_parameter", f"'{param}' is required", param)
        meaning.apply(value, param, draft)
    return _finish(draft, body, wire)


def _collect(container: Mapping[str, Any], fields: Mapping[str, Field], prefix: str,
             present: list[tuple[str, Field, Any]], is_open: bool) -> None:
    """The fields of `container` with a value (and the required ones), in the map's order; raises for a
    field the map does not have."""
    for name in container:
        if name not in fields and not is_open:
            if prefix:
                raise ProtocolError("unknown_parameter", f"'{prefix}{shown(name, 40)}' is not a parameter; "
                                    f"known: {', '.join(fields)}", prefix + name)
            raise ProtocolError("unknown_parameter", f"unknown parameter {shown(name, 40)}; docs/PROTOCOL.md "
                                "lists the fields this server takes", name)
    for name, meaning in fields.items():
        value, param = container.get(name), prefix + name
        if isinstance(meaning, Nested):
            if value is not None:
                _collect(check_value(value, dict, param), meaning.fields, f"{param}.", present, meaning.open)
        elif value is not None or meaning.required:
            present.append((param, meaning, value))


def _echoed(default: Any, value: Any) -> Any:
    if value is None:
        return copy.deepcopy(default)  # each response object its own
    return default | value if isinstance(default, dict) and isinstance(value, dict) else value


def _finish(draft: RequestDraft, body: Mapping[str, Any], wire: WireFormat) -> GenerationRequest:
    """The request from the checked fields: the rules between fields, then the input's size."""
    values = draft.values
    switch = values.get("logprobs_switch")
    if draft.needs_switch is not None and not switch:
        raise ProtocolError("invalid_value", f"'{draft.needs_switch}' needs '{wire.wire_names['logprobs_switch']}': "
                            "true", draft.needs_switch)
    if values.get("logprobs") is None and switch:
        values["logprobs"] = 0
    sampling = SamplingChoice(**{name: values[name] for name in SAMPLING_ORDER if name in values
                                 and name != "max_tokens"})
    request = GenerationRequest(
        input_messages=values.get("input_messages", []), images=values.get("images", ()), prompt=values.get("prompt"),
        instructions=values.get("instructions"), model=values.get("model"),
        previous_response_id=values.get("previous_response_id"),
        max_output_tokens=values.get("max_tokens", wire.default_max_tokens), sampling=sampling,
        metadata=values.get("metadata", {}), stream_id=values.get("stream_id"), store=values.get("store", wire.stores),
        generate=values.get("generate", True), stream=values.get("stream", wire.streams),
        context_tokens=values.get("context_tokens"), settings=values.get("settings", {}),
        include_usage=values.get("include_usage", False), tools=values.get("tools", ()),
        tool_choice=values.get("tool_choice", AUTO), parallel_tool_calls=values.get("parallel_tool_calls", True),
        tool_namespaces=values.get("tool_namespaces", {}),
        output_format=values.get("output_format"), reasoning=values.get("reasoning", ReasoningChoice()),
        keep_alive_s=values.get("keep_alive_s"),
        echoed={**{name: _echoed(default, body.get(name)) for name, default in wire.echoed.items()},
                **{name: body[name] for name in wire.echoed_if_sent if body.get(name) is not None}},
        wire_names={name: draft.names.get(name, spelled) for name, spelled in wire.wire_names.items()})
    _check_tool_choice(request, draft)
    limit, param = draft.limits.max_input_chars, request.wire_name("input")
    if request.num_input_chars > limit:
        with_instructions = " with the instructions" if request.instructions else ""
        raise ProtocolError("string_above_max_length", f"'{param}' holds {request.num_input_chars} characters"
                            f"{with_instructions}; at most {limit} are accepted", param)
    return request


def _check_tool_choice(request: GenerationRequest, draft: RequestDraft) -> None:
    """A tool the model cannot be offered (request_tool_fields.UnusableTool) is dropped when the tool choice calls
    none of it (`none`, a named function), else refused; `required` needs tools, and a named function must be one
    of them. (An answer's format beside tools under `auto` makes the answer either calls or a value of the
    format: server/generation/chat_turns.py.)"""
    choice = request.tool_choice
    unusable = draft.values.get("unusable_tools")
    if unusable and choice.mode in ("auto", "required"):
        raise unusable[0].refusal()
    param = draft.names.get("tool_choice", request.wire_names.get("tool_choice", "tool_choice"))
    try:
        choice.chosen_tools(request.tools)
    except ChatFormatError as error:
        at = draft.values.get("tool_choice_name_param", param) if choice.mode == "function" else param
        raise ProtocolError("invalid_value", f"'{at}': {error.reason}", at) from None

