"""An embedding request as OpenAI's `POST /v1/embeddings` and Ollama's `POST /api/embed` send it, checked
into one `EmbeddingRequest` (no I/O here). Errors name the field as the client spelled it, with the
index of the input at fault (`input[3]`, `input[2][7]`).

OpenAI's `input`: a string, an array of strings, an array of token ids, or an array of arrays of token
ids. Ollama's: a string or an array of strings. Neither may be empty, nor hold an empty input; at most
`RequestLimits.max_embedding_inputs` inputs and `max_input_chars` characters in all. Token ids are
checked against the vocabulary here; the token count of each input against the context once it is
tokenized (server/embeddings/api.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localserve.server.request.generation_request import RequestLimits
from localserve.server.request.keep_alive import parse_keep_alive
from localserve.server.request.validation import (
    ProtocolError,
    check_length,
    check_range,
    check_type,
    check_value,
    shown,
)

ENCODING_FORMATS = ("float", "base64")
MAX_DIMENSIONS = 1 << 20  # before the model's own bound: keeps the number an int a message can show
# Fields each API carries that change nothing here, and why.
OPENAI_IGNORED = {"user": "an end-user id for the provider's abuse monitoring"}


@dataclass(frozen=True)
class EmbeddingRequest:
    """A checked embedding request: one entry per input, text or token ids."""

    inputs: list[str | list[int]]
    model: str | None = None
    dimensions: int | None = None  # None: the model's full size
    encoding_format: str = "float"  # "float" | "base64" (little-endian float32, as OpenAI's SDK decodes it)
    truncate: bool = False  # an input longer than the context is cut to it (Ollama's default) instead of refused
    keep_alive_s: float | None = None  # Ollama's keep_alive (server/request/keep_alive.py)

    @property
    def num_chars(self) -> int:
        return sum(len(item) for item in self.inputs if isinstance(item, str))

MAX_TOKEN_ID = 2**31 - 1  # an id no vocabulary reaches; the model's own bound is checked once it is known

def parse_openai_embeddings(body: dict[str, Any], limits: RequestLimits) -> EmbeddingRequest:
    """OpenAI's embeddings body (https://platform.openai.com/docs/api-reference/embeddings/create). Token ids
    are checked as ids here and against the vocabulary of the model named once it is known
    (`check_token_ids`)."""
    _check_known(body, ("input", "model", "dimensions", "encoding_format", *OPENAI_IGNORED))
    inputs = _inputs(body, limits, token_ids=True)
    encoding_format = check_type(body, "encoding_format", str) or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise ProtocolError("invalid_value", f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got "
                            f"{shown(encoding_format)}", "encoding_format")
    return EmbeddingRequest(inputs, _model(body, limits), _dimensions(body), encoding_format)


def parse_ollama_embed(body: dict[str, Any], limits: RequestLimits) -> EmbeddingRequest:
    """Ollama's embed body (https://github.com/ollama/ollama/blob/main/docs/api.md#generate-embeddings)."""
    _check_known(body, ("input", "model", "dimensions", "truncate", "options", "keep_alive"))
    inputs = _inputs(body, limits, token_ids=False)
    options = check_type(body, "options", dict)
    if options:
        name = next(iter(options))
        raise ProtocolError("unsupported_parameter", f"'options.{shown(name, 40)[1:-1]}' is not supported on "
                            "/api/embed (an embedding is the same whatever the sampling)", f"options.{name}")
    truncate = check_type(body, "truncate", bool)
    keep_alive = body.get("keep_alive")
    return EmbeddingRequest(inputs, _model(body, limits), _dimensions(body), "float",
                            truncate=True if truncate is None else truncate,
                            keep_alive_s=None if keep_alive is None else parse_keep_alive(keep_alive, "keep_alive"))


def _check_known(body: dict[str, Any], known: tuple[str, ...]) -> None:
    for name in body:
        if name not in known:
            raise ProtocolError("unknown_parameter", f"unknown parameter {shown(name, 60)}", name[:100])


def _model(body: dict[str, Any], limits: RequestLimits) -> str | None:
    model = check_type(body, "model", str)
    check_length(model, "model", limits.max_id_chars)
    return model


def _dimensions(body: dict[str, Any]) -> int | None:
    dimensions = check_type(body, "dimensions", int)
    check_range(dimensions, "dimensions", 1, MAX_DIMENSIONS, integer=True)
    return dimensions


def _check_present(value: Any, expected: type | tuple[type, ...], param: str) -> None:
    """check_value, with null refused too (an item of `input` is never optional)."""
    if value is None:
        raise ProtocolError("invalid_type", f"'{param}' must not be null", param)
    check_value(value, expected, param)


def check_token_ids(request: EmbeddingRequest, vocab_size: int) -> None:
    """Every token id of `request` below `vocab_size` (the model's vocabulary), naming the first that is not."""
    for index, item in enumerate(request.inputs):
        if isinstance(item, list):
            for position, token in enumerate(item):
                check_range(token, f"input[{index}][{position}]", 0, vocab_size - 1, integer=True)


def _inputs(body: dict[str, Any], limits: RequestLimits, token_ids: bool) -> list[str | list[int]]:
    """`input` as a list of inputs, each a non-empty string or (OpenAI) a non-empty list of token ids."""
    if "input" not in body or body["input"] is None:
        raise ProtocolError("missing_required_parameter", "'input' is required", "input")
    value = body["input"]
    kinds = (str, list)
    check_value(value, kinds, "input")
    if isinstance(value, str):
        value = [value]
    elif token_ids and value and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        value = [value]  # one input of token ids
    if not value:
        raise ProtocolError("invalid_value", "'input' must not be an empty array", "input")
    check_length(value, "input", limits.max_embedding_inputs)
    inputs: list[str | list[int]] = []
    for index, item in enumerate(value):
        param = f"input[{index}]"
        _check_present(item, (str, list) if token_ids else str, param)
        if not item:
            raise ProtocolError("invalid_value", f"'{param}' must not be empty", param)
        if isinstance(item, list):
            for position, token in enumerate(item):
                _check_present(token, int, f"{param}[{position}]")
                check_range(token, f"{param}[{position}]", 0, MAX_TOKEN_ID, integer=True)
        inputs.append(item)
    num_chars = sum(len(item) for item in inputs if isinstance(item, str))
    if num_chars > limits.max_input_chars:
        raise ProtocolError("string_above_max_length", f"'input' holds {num_chars} characters; at most "
                            f"{limits.max_input_chars} are accepted", "input")
    return inputs
