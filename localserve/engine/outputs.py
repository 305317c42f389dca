"""What the engine reports about a request: per sequence text, tokens, log-probabilities, why it stopped."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localserve.engine.sequence import TokenSpan
from localserve.engine.stop_reason import StopReason

__all__ = ["CompletionOutput", "RequestOutput", "StopReason", "make_output"]

if TYPE_CHECKING:
    from localserve.engine.sequence import Request


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (a sample or a beam)."""

    index: int
    text: str
    # The generated ids: a list once the request has finished; before that a read-only TokenSpan on the
    # sequence's own list (fixed at this step's length), so a step copies no whole output.
    token_ids: Sequence[int]
    cumulative_logprob: float | None  # for n > 1, beams and when logprobs are asked for; else None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[float] = field(default_factory=list)  # of each chosen token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    delta_text: str = ""  # text added by the step that produced this output (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    # Output tokens inside the reasoning block (SamplingParams.reasoning_end), the one that ends it included.
    num_reasoning_tokens: int = 0
    stop: StopReason | None = None  # why it stopped (engine/stop_reason.py), once it has; None while running


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step; `finished` once every sequence is done."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    # An embedding request's pooled vector, on its final output (its `outputs` stay empty: nothing is generated).
    embedding: list[float] | None = None

    @property
    def text(self) -> str:
        """The first output's text (the only one unless n > 1)."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> Sequence[int]:
        """The first output's generated token ids."""
        return self.outputs[0].token_ids if self.outputs else []


def make_output(request: Request, finished: bool, tokenizer=None) -> RequestOutput:
    """The request's outputs; deltas hold what is new since the last call (which this call records).

    Nothing here is O(output length) but the final call: a delta is sliced from the tail of the text and
    of the token ids, and the token ids of an unfinished output are a view, not a copy.
    """
    if request.pooling is not None:
        return RequestOutput(request.request_id, request.prompt_token_ids, [], finished, request.num_cached_tokens,
                             request.error, request.embedding)
    seqs = request.seqs
    beam_search = request.beam_search
    if len(seqs) == 1 and not beam_search and not request.stop_strings:  # the common case, in short
        seq = seqs[0]
        text, token_ids, prompt_len = seq.text, seq.token_ids, seq.prompt_len
        num_tokens = len(token_ids)
        output = CompletionOutput(
            0, text, token_ids[prompt_len:] if finished else TokenSpan(token_ids, prompt_len, num_tokens),
            seq.cumulative_logprob if seq.logprobs else None, seq.finish_reason, seq.logprobs, seq.top_logprobs,
            text[seq.num_emitted_chars:], token_ids[prompt_len + seq.num_emitted_tokens:], seq.num_reasoning_tokens,
            seq.stop)
        seq.num_emitted_chars, seq.num_emitted_tokens = len(text), num_tokens - prompt_len
        return RequestOutput(request.request_id, request.prompt_token_ids, [output], finished,
                             request.num_cached_tokens, request.error)
    if beam_search:
        seqs = sorted(request.seqs + request.finished_beams, key=lambda s: -s.cumulative_logprob)[:request.params.n]
    # Text that may still turn into the start of a stop string is held back until it cannot.
    hold_back = max(map(len, request.stop_strings)) - 1 if request.stop_strings else 0
    outputs = []
    for index, seq in enumerate(seqs):
        text = seq.text
        if beam_search:
            text = (tokenizer.decode(seq.output_token_ids, skip_special_tokens=request.params.skip_special_tokens)
                    if tokenizer and finished else "")
        num_visible = len(text)
        if hold_back and not (seq.finish_reason or finished):
            num_visible = min(num_visible, max(seq.num_emitted_chars, num_visible - hold_back))
        token_ids, prompt_len = seq.token_ids, seq.prompt_len
        num_tokens = len(token_ids)
        outputs.append(CompletionOutput(
            index, text, token_ids[prompt_len:] if finished else TokenSpan(token_ids, prompt_len, num_tokens),
            seq.cumulative_logprob if seq.logprobs else None, seq.finish_reason, seq.logprobs, seq.top_logprobs,
            text[seq.num_emitted_chars:num_visible], token_ids[prompt_len + seq.num_emitted_tokens:],
            seq.num_reasoning_tokens, seq.stop))
        seq.num_emitted_chars, seq.num_emitted_tokens = num_visible, num_tokens - prompt_len
    return RequestOutput(request.request_id, request.prompt_token_ids, outputs, finished,
                         request.num_cached_tokens, request.error)
