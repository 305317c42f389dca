"""What the engine reports about a request: per sequence text, tokens, log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localserve.engine.sequence import Request


@dataclass
class CompletionOutput:
    """One generated sequence (a sample or a beam)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # for n > 1, beams and when logprobs are asked for; else None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[float] = field(default_factory=list)  # of each chosen token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    delta_text: str = ""  # text added by the step that produced this output (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """The state of one request after an engine step; `finished` once every sequence is done."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def text(self) -> str:
        """The first output's text (the only one unless n > 1)."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        """The first output's generated token ids."""
        return self.outputs[0].token_ids if self.outputs else []


def stop_string_cut(text: str, stops: list[str], new_from: int) -> int | None:
    """Where to cut `text` (the index a stop string starts at), or None, given that `text[:new_from]`
    held no stop string.

    The text ends before the first stop string to be completed, reading character by character: the one
    that ends earliest, the longest of those that end together. So the cut does not depend on how the
    text was split into tokens, and a stop string ending inside the newest token is found however long
    that token is.
    """
    first: tuple[int, int, int] | None = None  # (end, -length, start)
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start >= 0 and (first is None or (start + len(stop), -len(stop)) < first[:2]):
            first = (start + len(stop), -len(stop), start)
    return None if first is None else first[2]


def make_output(request: Request, finished: bool, tokenizer=None) -> RequestOutput:
    """The request's outputs; deltas hold what is new since the last call (which this call records)."""
    params = request.params
    seqs = request.seqs
    if params.beam_search:
        seqs = sorted(request.seqs + request.finished_beams, key=lambda s: -s.cumulative_logprob)[:params.n]
    # Text that may still turn into the start of a stop string is held back until it cannot.
    hold_back = max((len(stop) for stop in params.stop), default=1) - 1
    outputs = []
    for index, seq in enumerate(seqs):
        text = seq.text
        if params.beam_search:
            text = tokenizer.decode(seq.output_token_ids) if tokenizer and finished else ""
        visible = text if seq.finished or finished else text[:max(seq.num_emitted_chars, len(text) - hold_back)]
        output_ids = seq.output_token_ids
        outputs.append(CompletionOutput(
            index, text, list(output_ids), seq.cumulative_logprob if seq.logprobs else None,
            seq.finish_reason, seq.logprobs,
            seq.top_logprobs, delta_text=visible[seq.num_emitted_chars:],
            delta_token_ids=output_ids[seq.num_emitted_tokens:]))
        seq.num_emitted_chars, seq.num_emitted_tokens = len(visible), len(output_ids)
    return RequestOutput(request.request_id, request.prompt_token_ids, outputs, finished,
                         request.num_cached_tokens, request.error)
