"""Requests and their sequences (parallel samples or beams), as the engine tracks them, and a sequence's
row of a step (here, not in engine/batch.py, because a decoding sequence keeps its row)."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from localserve.engine.sampling_params import SamplingParams
from localserve.engine.spec_state import SpecState
from localserve.engine.step import SeqChunk
from localserve.engine.stop_reason import StopReason

if TYPE_CHECKING:
    import torch

    from localserve.engine.constraints import SequenceGrammar
    from localserve.engine.multimodal import MultiModalInputs
    from localserve.engine.pooling import PromptPooling
    from localserve.engine.sampler import SamplingRow


class TokenSpan(SequenceABC):
    """A read-only window [start, stop) on a token list that only ever grows (stop None: its current end).

    It spares copying a sequence's whole output every step: a window with a fixed stop keeps reading the
    same tokens however many are appended after it, so an output can hand one to another thread.
    """

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int | None = None) -> None:
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        return (len(self._tokens) if self._stop is None else self._stop) - self._start

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return list(self)[index]
        length = len(self)
        if not -length <= index < length:
            raise IndexError("token index out of range")
        return self._tokens[self._start + index % length]

    def __iter__(self) -> Iterator[int]:
        return islice(self._tokens, self._start, self._start + len(self))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, TokenSpan)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


class RequestState(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recompute (its KV is gone)
    RUNNING = "running"  # holds GPU blocks; prefilling or decoding
    SWAPPED = "swapped"  # preempted by swap: its blocks sit in the CPU pool
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # identity: a sequence is only ever equal to itself
class Sequence:
    """One line of generation. Its KV covers `num_computed_tokens` of `token_ids`."""

    seq_id: int
    prompt_len: int
    token_ids: list[int]  # prompt + generated
    generator: torch.Generator
    # The fields a decode step reads come first: with __slots__ they share the object's first cache lines.
    num_computed_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # The last sampled token is in token_ids but not yet in the block manager (appended when scheduled).
    pending_append: bool = False
    sampling_row: SamplingRow | None = None  # what the sampler reads of it, made at its first sampling
    # Its row of a decode step, rewritten by the scheduler each step (engine/batch.py). The row refers back
    # to it: the scheduler drops the row when the sequence leaves its request (Scheduler.finish, a dropped
    # beam), so that nothing of a finished request waits for the cyclic garbage collector.
    decode_row: ScheduledRow | None = None
    decoder: object | None = None  # the tokenizer's StreamDecoder, when text is wanted
    speculation: SpecState | None = None  # its speculative decoding, from its first draft on
    text: str = ""  # detokenized output so far (stop strings cut off)
    num_emitted_chars: int = 0  # text already reported to a streaming client
    num_emitted_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    grammar: SequenceGrammar | None = None  # its matcher, when the request has a grammar
    # Inside the request's reasoning block (from the start of the output until `reasoning_end` appears).
    in_reasoning: bool = False
    num_reasoning_tokens: int = 0  # output tokens of the reasoning block, the one that ends it included
    # Why it stopped, set with finish_reason (engine/stop_reason.py); last: the fields before it keep their places.
    stop: StopReason | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens (O(output length): not for every step; see `output_span`)."""
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def output_span(self, live: bool = False) -> TokenSpan:
        """The generated tokens without a copy: as of now, or (live) as they will grow."""
        return TokenSpan(self.token_ids, self.prompt_len, None if live else len(self.token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not written yet: 1 while decoding, more while (re)prefilling."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False, slots=True)
class Request:
    """A prompt, its sampling parameters, and the sequences generating from it."""

    request_id: str
    arrival: int  # order of arrival; preemption picks the largest among running requests
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    # The fields a decode step reads come first (see Sequence).
    forked: bool = False  # parallel samples / beams created (at the first sampled token)
    # Readmitted after a preemption and not yet sampled a token since: not the next victim (no thrashing).
    just_readmitted: bool = False
    first_token_time: float | None = None
    state: RequestState = RequestState.WAITING
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    # Sequences readmitted after a recompute that share blocks their leader has not computed yet: they
    # wait for it (the scheduler and BlockManager.allocate_sharing keep this).
    followers: list[Sequence] = field(default_factory=list)
    finished_beams: list[Sequence] = field(default_factory=list)
    beam_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # next-token logits of ready beams
    # An embedding request: its prompt only is prefilled and pooled here; `embedding` is the vector once done.
    pooling: PromptPooling | None = None
    embedding: list[float] | None = None
    # False: its prompt takes no prefix-cache hits (its pooling reads every token's hidden state).
    uses_prefix_cache: bool = True
    # What every step asks of params, kept here so that a step reads the request alone. The engine passes
    # the first two (the model's end-of-sequence ids unless ignore_eos, its context length); else they come
    # from params. The caller's own stop_token_ids are read from params at each token (a list, mostly empty).
    eos_ids: frozenset[int] = frozenset()  # a sampled id among these ends its sequence with "stop"
    max_num_tokens: int | None = None  # a sequence reaching this many tokens ends with "length"
    stop_strings: list[str] = field(init=False)
    reasoning_end: str | None = field(init=False)
    beam_search: bool = field(init=False)
    # Its prompt's images (engine/multimodal.py), shared by its samples and beams, kept through preemptions, and
    # each block's own prefix-cache key part they make (`block_extra_keys`).
    multimodal: MultiModalInputs | None = None
    block_extra_keys: tuple[bytes, ...] = ()
    # Its bidirectional spans' (offset, end), in prompt order: no prefill chunk ends strictly inside one
    # (engine/batch.py, `span_safe_chunk`).
    bidirectional_spans: tuple[tuple[int, int], ...] = ()
    # Its images' (offset, end, content hash), in prompt order: what the step's time budget charges their
    # encodes by (engine/encode_budget.py).
    image_spans: tuple[tuple[int, int, bytes], ...] = ()

    def __post_init__(self) -> None:
        params = self.params
        if self.max_num_tokens is None:
            self.max_num_tokens = len(self.prompt_token_ids) + params.max_tokens
        self.stop_strings = params.stop
        self.reasoning_end = params.reasoning_end
        self.beam_search = params.beam_search

    @property
    def label(self) -> str:
        """How the monitor names this request: its arrival number, not its id (ids can continue responses)."""
        return f"r{self.arrival}"

    @property
    def live_seqs(self) -> list[Sequence]:
        """The unfinished sequences (read-only: for a lone sequence this is `seqs` itself, not a copy)."""
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs if seqs[0].finish_reason is None else []
        return [seq for seq in seqs if seq.finish_reason is None]

    @property
    def num_slots(self) -> int:
        """Sequences it runs: its `n` samples or beams until they are forked, then the live ones."""
        return len(self.live_seqs) if self.forked else self.params.n

    @property
    def num_output_tokens(self) -> int:
        return sum(seq.num_output_tokens for seq in self.seqs + self.finished_beams)

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED


@dataclass(eq=False, slots=True)
class ScheduledRow:
    """One sequence's row of a step: its request, the sequence, its query tokens and its chunk for the
    model runner. `query_len` is len(chunk.token_ids), kept as a field: every row of a step reads it.
    A verify row (speculative decoding) is a decode row whose last `num_draft_tokens` tokens are a draft."""

    request: Request
    seq: Sequence
    query_len: int
    chunk: SeqChunk
    num_draft_tokens: int = 0
