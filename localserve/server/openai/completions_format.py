"""OpenAI's two older endpoints as this server reads them: the field maps of `POST /v1/chat/completions`
and `POST /v1/completions` (no I/O here).

Like `response.create` (server/openai/responses_format.py), every field of OpenAI's request is honoured,
ignored for a stated reason, or refused with `unsupported_parameter` when honouring it would change
the output and this server cannot; any other field is an `unknown_parameter`. The sampling fields
llama.cpp and vLLM add (`top_k`, `min_p`, `repetition_penalty`) are top-level fields here: the same
shared fields as the websocket mode's `localserve` object. docs/PROTOCOL.md lists them.
"""

from __future__ import annotations

from typing import Any

from localserve.server.request import fields, tool_fields
from localserve.server.request.images import ImageBounds, check_detail, read_image_url
from localserve.server.request.messages import MessageFormat
from localserve.server.request.validation import ProtocolError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
LEGACY_FUNCTIONS = "the deprecated functions API is not supported; send tools and tool_choice"


def _image_url_part(part: dict[str, Any], where: str, bounds: ImageBounds) -> tuple[bytes, None]:
    """An `image_url` part: {"type": "image_url", "image_url": {"url": a data URL, "detail"}}."""
    image_url = part.get("image_url")
    if not isinstance(image_url, dict):
        raise ProtocolError("invalid_type", f"'{where}.image_url' must be an object {{\"url\": a data URL}}",
                            f"{where}.image_url")
    check_detail(image_url, f"{where}.image_url")
    return read_image_url(image_url.get("url"), f"{where}.image_url.url", bounds), None


CHAT_MESSAGES = MessageFormat(text_parts=("text",), at_least_one=True,
                                     refused_roles={"function": LEGACY_FUNCTIONS},
                                     refused_fields=("function_call", "audio"),
                                     unused_text_fields=("name", "refusal"),  # the templates use neither
                                     null_assistant_content=True, tool_turns="chat",
                                     image_parts={"image_url": _image_url_part},
                                     reasoning_fields=("reasoning_content", "reasoning"))
TEXT_ONLY = "the server answers in text only"


def _text_only(modalities: list[Any]) -> bool:
    return modalities == ["text"]


# Fields of both endpoints: the model, the shared sampling fields at the top level, streaming.
COMMON: dict[str, fields.Field] = {
    "model": fields.Text("model", bounded=True),
    "max_tokens": fields.Sampling("max_tokens"),
    **{name: fields.Sampling(name) for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
                                                "presence_penalty", "frequency_penalty", "repetition_penalty")},
    "stream": fields.Flag("stream"),
    "stream_options": fields.Nested({"include_usage": fields.Flag("include_usage")}, open=True),
    "logit_bias": fields.Refused("token biases are not applied; leave it empty", kind=dict),
    "user": fields.Ignored("there are no accounts"),
    "safety_identifier": fields.Ignored("there are no accounts"),
    "service_tier": fields.Ignored("there is one tier"),
    "prompt_cache_key": fields.Ignored("the prefix cache finds shared blocks by their content, with no key"),
    "prompt_cache_retention": fields.Ignored("cached blocks stay until the pool needs them"),
}

CHAT_COMPLETIONS = fields.WireFormat({
    "messages": fields.Messages(CHAT_MESSAGES),
    **COMMON,
    "max_completion_tokens": fields.Sampling("max_tokens", preferred=True),
    "logprobs": fields.LogprobsSwitch(),
    "top_logprobs": fields.Sampling("logprobs", needs_switch=True),
    "tools": tool_fields.Tools(),
    "tool_choice": tool_fields.ToolChoiceField(),
    "parallel_tool_calls": fields.Flag("parallel_tool_calls"),
    "function_call": fields.Refused(LEGACY_FUNCTIONS, fields.one_of("auto", "none"), (str, dict)),
    "functions": fields.Refused(LEGACY_FUNCTIONS, fields.is_empty, list),
    "response_format": tool_fields.OutputFormatField(),
    "reasoning_effort": tool_fields.ReasoningEffort(),
    "modalities": fields.Refused(TEXT_ONLY, _text_only, list),
    "audio": fields.Refused(TEXT_ONLY),
    "prediction": fields.Refused("predicted outputs are not used"),
    "web_search_options": fields.Refused("there is no web search"),
    "verbosity": fields.Refused("the answer's length is set with max_completion_tokens", fields.one_of("medium"),
                                str),
    "store": fields.Ignored("chat completions are not stored; use /v1/responses with previous_response_id to "
                            "continue"),
    "metadata": fields.Ignored("chat completions are not stored, so there is nothing to tag"),
}, stores=False)

COMPLETIONS = fields.WireFormat({
    "prompt": fields.Prompt(),
    **COMMON,
    "logprobs": fields.Sampling("logprobs"),
    "echo": fields.Refused("the prompt is not repeated in the answer", kind=bool),
    "suffix": fields.Refused("there is no fill-in-the-middle", kind=str),
    "best_of": fields.Refused("use n to sample several completions", fields.one_of(1), int),
}, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, stores=False)
