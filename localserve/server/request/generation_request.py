"""The one request type every API's generation request becomes, whatever its wire format (no I/O here).

A format's field map (server/openai/responses_format.py, server/openai/completions_format.py) is read by the one
parser of server/request/fields.py into a `GenerationRequest`: what to say, what the client chose of
the sampling (`SamplingChoice`: a field it left out stays None), and how the answer is to be shaped.
The server's sampling defaults fill in what the client left out, once, in `sampling_params`. A bound
checked after parsing (the context, the conversation's size) names the field as the client's format
spells it, through `wire_name`.

Tools, the tool choice, the answer's format and reasoning are fields of any wire format's making: `tools`
(tokenizer/tools.py's `ToolSpec`), `tool_choice` (`ToolChoice`), `parallel_tool_calls`, `output_format`
(an `OutputFormat`: JSON of a schema or any JSON object, which becomes the engine's `GrammarSpec`) and
`reasoning` (a `ReasoningChoice`: the template's default, or thinking on or off with an effort). A
conversation's messages carry tool turns as chat completions spell them (`Message`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from localserve.engine.grammar import JSON_DEFAULTS, GrammarSpec
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.request.images import ImageBounds, PlacedImage
from localserve.tokenizer.tools import AUTO, ToolChoice, ToolSpec

# {"role": "user" | "assistant" | "system" | "tool", "content": text}; an assistant's calls in "tool_calls"
# ([{"id", "type": "function", "function": {"name", "arguments": JSON text of an object}}]), a tool result's call
# in "tool_call_id" (as chat completions spell them, whatever the wire format; None until resolved by the
# function's "name" when the API lets a result name the function instead of the call).
Message = dict[str, Any]
# An assistant's call whose arguments are no JSON object (cut short: an older answer may hold one) is the model's
# own text: its arguments join the message's content, and its id is kept under this key so that a tool result
# may still answer it; the key never reaches a chat template (`template_view`).
UNFINISHED_CALL_IDS = "unfinished_call_ids"
# A stored conversation's message keeps its images under this key ((offset in its content, ImageInput), ...:
# server/generation/image_prompt.py), so a follow-up's prompt holds them again; never shown to a template.
STORED_IMAGES = "stored_images"
BOOKKEEPING_KEYS = (UNFINISHED_CALL_IDS, STORED_IMAGES)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def is_json_object(text: str) -> bool:
    """True when `text` is the JSON text of an object."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def template_view(message: Message) -> Message:
    """The message as a chat template is handed it (without this server's bookkeeping)."""
    if not any(key in message for key in BOOKKEEPING_KEYS):
        return message
    return {key: value for key, value in message.items() if key not in BOOKKEEPING_KEYS}


def message_chars(message: Message) -> int:
    """The characters a message holds: its text and its calls' names and arguments."""
    calls = message.get("tool_calls") or ()
    return len(message["content"]) + sum(len(call["function"]["name"]) + len(call["function"]["arguments"])
                                         for call in calls)


@dataclass(frozen=True)
class OutputFormat:
    """What the answer must be (chat completions' `response_format`, Responses' `text.format`): a JSON value
    of `schema` (`json_schema`; `strict`: a keyword the engine cannot enforce is refused, not ignored) or
    any JSON object (`json_object`, schema None). `name` is the schema's, echoed."""

    kind: str  # "json_schema" | "json_object"
    schema: Mapping[str, Any] | None = None
    strict: bool = False
    name: str | None = None

    def grammar(self) -> GrammarSpec:
        """The engine's grammar for it; ValueError naming why a schema cannot be one."""
        if self.kind == "json_object":
            return GrammarSpec.json_object()
        return GrammarSpec.json_schema(self.schema, strict=self.strict)

    def embedded_schema(self) -> dict[str, Any]:
        """The schema with the settings `grammar` compiles it with (as `x-guidance`), for a larger grammar that
        holds it (a tool-call grammar whose answer may be a value of it instead of calls)."""
        if self.kind == "json_object":
            return {"type": "object", "x-guidance": {**JSON_DEFAULTS, "lenient": False}}
        schema = dict(self.schema or {})
        return {**schema, "x-guidance": {**JSON_DEFAULTS, **schema.get("x-guidance", {}), "lenient": not self.strict}}


@dataclass(frozen=True)
class ReasoningChoice:
    """Whether a model that reasons thinks before answering: `effort` as the client gave it (None: the chat
    template's default); "none" turns thinking off where the template can."""

    effort: str | None = None

    @property
    def thinking(self) -> bool:
        return self.effort != "none"

    @property
    def chosen(self) -> bool:
        """True when the client set it."""
        return self.effort is not None


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on everything a client sizes in one request (documented in docs/PROTOCOL.md)."""

    max_input_chars: int = 1 << 20  # input text plus instructions of one request, before tokenization
    max_conversation_chars: int = 4 << 20  # a stored conversation plus the new input
    max_input_items: int = 4096
    max_embedding_inputs: int = 2048  # inputs of one embeddings request (OpenAI's bound)
    max_stop_strings: int = 8
    max_stop_chars: int = 128  # each stop string is searched for after every token
    max_parallel_samples: int = 16
    max_logprob_entries: int = 1 << 16  # (logprobs + 1) x n x max_output_tokens: the closing events' size
    max_metadata_keys: int = 16
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 512
    max_client_metadata_keys: int = 64  # client_metadata: a client's own tags, only echoed
    max_client_metadata_value_chars: int = 8192
    max_id_chars: int = 256  # model and previous_response_id
    max_tools: int = 128  # tools offered in one request (each adds its schema to the prompt and the grammar)
    images: ImageBounds = ImageBounds()  # the images of one request: bytes, count, pixels


@dataclass(frozen=True)
class SamplingChoice:
    """The sampling fields a request set, checked; None where it left the choice to the server."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    n: int | None = None
    logprobs: int | None = None  # alternatives per token, when log-probabilities are wanted
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    @property
    def num_samples(self) -> int:
        return self.n or 1


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request for one response: what to say, how to sample, how to shape the answer."""

    input_messages: list[Message]  # this turn's input, roles user/assistant/system/tool
    # the input's images, decoded: each with the index of its message in input_messages (0: the prompt, for a
    # prompt tokenized as it is) and the character of that message's content it stands before, in order
    images: tuple[PlacedImage, ...] = ()
    prompt: str | None = None  # instead of messages: text tokenized as it is, no chat template (completions)
    instructions: str | None = None
    model: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None  # None: the server's default
    context_tokens: int | None = None  # prompt plus output at most (Ollama's num_ctx); None: the context
    sampling: SamplingChoice = SamplingChoice()
    metadata: dict[str, str] = field(default_factory=dict)
    stream_id: str | None = None  # the websocket lane
    store: bool = True  # False: only the connection that made it may continue it
    generate: bool = True  # False: prefill the input into the cache, answer with no output
    stream: bool = False  # over HTTP: server-sent events as the answer is generated
    include_usage: bool = False  # a streamed completion ends with a chunk holding the usage
    tools: tuple[ToolSpec, ...] = ()
    tool_namespaces: Mapping[str, str] = field(default_factory=dict)  # a function of a Responses namespace -> it
    tool_choice: ToolChoice = AUTO
    parallel_tool_calls: bool = True  # False: at most one call per answer
    output_format: OutputFormat | None = None  # None: free text
    reasoning: ReasoningChoice = ReasoningChoice()
    keep_alive_s: float | None = None  # Ollama's keep_alive: the model's idle time before unloading (inf: never)
    echoed: dict[str, Any] = field(default_factory=dict)  # what a Responses object echoes as requested
    settings: dict[str, Any] = field(default_factory=dict)  # an endpoint's own fields (request_fields.Setting)
    wire_names: Mapping[str, str] = field(default_factory=dict)  # shared field -> the format's name for it

    @property
    def has_input(self) -> bool:
        """False for a request with nothing to say (Ollama's way of asking that the model be loaded)."""
        return bool(self.input_messages) or self.prompt is not None or self.previous_response_id is not None

    @property
    def num_input_chars(self) -> int:
        return (sum(message_chars(message) for message in self.input_messages) + len(self.instructions or "")
                + len(self.prompt or ""))

    def wire_name(self, name: str) -> str:
        """How the request's format names the shared field `name` ("input", "max_tokens"); a format without
        the field (`/api/show` has no input) leaves it its shared name."""
        return self.wire_names.get(name, name)

    def sampling_params(self, defaults: SamplingDefaults, max_tokens: int, **turn: Any) -> SamplingParams:
        """The engine's SamplingParams, `max_tokens` resolved against the prompt: the server's `defaults`
        for temperature and the filters the request left out, SamplingParams' own for the rest; `turn`: the
        fields the chat turn sets (grammar, reasoning_end, skip_special_tokens). The values passed the
        request's field rules, which are at least as strict as SamplingParams' checks."""
        sampling = self.sampling
        chosen = {item.name: getattr(sampling, item.name) for item in dataclasses.fields(sampling)
                  if getattr(sampling, item.name) is not None}
        if "stop" in chosen:
            chosen["stop"] = list(chosen["stop"])
        server = {"temperature": defaults.temperature, "top_k": defaults.top_k, "top_p": defaults.top_p,
                  "min_p": defaults.min_p}
        return SamplingParams(max_tokens=max_tokens, **(server | chosen | turn))
