"""Log-probabilities as OpenAI's chat completions and Responses spell them: each token with its UTF-8 bytes,
its log-probability and its alternatives (no I/O here)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from localserve.server.generation.sample_output import TokenLogprob


def logprob_entries(entries: Iterable[TokenLogprob]) -> list[dict[str, Any]]:
    """`{token, bytes, logprob, top_logprobs}` for each entry."""
    return [{**_token(entry.token, entry.logprob),
             "top_logprobs": [_token(token, logprob) for token, logprob in entry.top]} for entry in entries]


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "bytes": list(text.encode()), "logprob": logprob}
