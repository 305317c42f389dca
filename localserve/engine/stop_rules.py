"""What a sampled token does to its sequence: it is appended, with its log-probability and its text, and it
may end the sequence: an end-of-sequence or stop token, a stop string completed in the text (the text cut
where it begins), the sequence's grammar complete, or the length limit; it may end the reasoning block.
Why it ended is a StopReason (engine/stop_reason.py). No torch here."""

from __future__ import annotations

from localserve.engine.sequence import Request, Sequence
from localserve.engine.stop_reason import GRAMMAR_COMPLETE, LENGTH, StopReason


def append_sampled_token(request: Request, seq: Sequence, token_id: int, logprob: float | None,
                         top_logprobs: list[tuple[int, float]] | None) -> StopReason | None:
    """Append `token_id` to `seq` of `request`; returns why the sequence ends with it, or None while it
    goes on (an end-of-sequence id among the caller's stop_token_ids is reported as "eos"). The block
    manager gets the token when the next step schedules it. The sequence's grammar sees every token that
    does not end it first (constraints.GrammarRejected for one it does not allow)."""
    token_ids = seq.token_ids
    token_ids.append(token_id)
    seq.pending_append = True
    if logprob is not None:
        seq.cumulative_logprob += logprob
        seq.logprobs.append(logprob)
        seq.top_logprobs.append(top_logprobs or [])
    if token_id in request.eos_ids:
        return StopReason("eos", token_id)
    if token_id in request.params.stop_token_ids:
        return StopReason("stop_token", token_id)
    if seq.decoder is not None:
        new_from = len(seq.text)
        seq.text += seq.decoder.step(token_id)
        if seq.in_reasoning:
            seq.num_reasoning_tokens += 1
            marker = request.reasoning_end
            seq.in_reasoning = seq.text.find(marker, max(0, new_from - len(marker) + 1)) < 0
        if request.stop_strings and (met := first_stop_string(seq.text, request.stop_strings, new_from)):
            cut, stop = met
            seq.text = seq.text[:cut]
            return StopReason("stop_string", stop_string=stop)
    if seq.grammar is not None and seq.grammar.advance(token_id):
        return GRAMMAR_COMPLETE
    if len(token_ids) >= request.max_num_tokens:
        return LENGTH
    return None


def first_stop_string(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """The stop string that ends `text` and where to cut it (the index it starts at), or None, given that
    `text[:new_from]` held no stop string.

    The text ends before the first stop string to be completed, reading character by character: the one
    that ends earliest, the longest of those that end together. So the cut does not depend on how the
    text was split into tokens, and a stop string ending inside the newest token is found however long
    that token is.
    """
    first: tuple[int, int, int, str] | None = None  # (end, -length, start, stop)
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start >= 0 and (first is None or (start + len(stop), -len(stop)) < first[:2]):
            first = (start + len(stop), -len(stop), start, stop)
    return None if first is None else first[2:]
