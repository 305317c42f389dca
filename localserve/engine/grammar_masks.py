"""The token masks of a step's constrained rows: filled while the model runs, added to the logits after.

`GrammarMasks.start(rows)` runs right after the step is scheduled: the matchers have seen every token
sampled so far (the previous step's included), so each constrained row's mask for its next token is
known before the forward. A worker thread fills them (llguidance's fill holds no GIL) and turns the
bits into an additive bias (0 where allowed, -inf elsewhere) in a pinned host buffer while the main
thread runs the model; `PendingMasks.apply(logits)` waits for it, copies
the bias to the logits' device and adds it to those rows in place, before the sampler reads them.
Unconstrained rows are not touched, and a step without a constrained row does nothing at all.
A verify row of speculative decoding gets a mask at each place of its draft: the matcher is walked
through the draft on the worker and rolled back (`_fill`).

The worker fills the rows one after the other, not with llguidance's parallel executor: a mask costs
microseconds (more only where a grammar branches a lot), and the executor's thread pool, spinning
for work, took the cores from the model's own threads: on 2 cores its fill of 16 rows took 5-8 ms
against 1 ms one by one, and the step's apply after it 8-9 ms against 0.4-1.8 ms
(scripts/bench_constrained.py).

So penalties, temperature, top-k / top-p / min-p and greedy choice all work on masked logits, and an
end-of-sequence token is allowed only where the grammar is complete (llguidance's mask). The one
host buffer is safe to refill each step: the sampler's copy to the host ends the step, after the
bias has been read.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from localserve.engine.sequence import ScheduledRow

if TYPE_CHECKING:
    from llguidance import LLMatcher

NEG_INF_BITS = np.uint32(0xFF800000)  # float32 -inf; 0 bits are 0.0


@dataclass(frozen=True, slots=True)
class MaskTiming:
    """One step's masks: how many rows, the fill on the worker (llguidance and the bias), how long the
    step waited for it after the forward, and the copy and add on the logits."""

    num_rows: int
    fill_s: float
    wait_s: float
    apply_s: float


@dataclass(slots=True)
class PendingMasks:
    """The masks of one step, being filled; `apply` adds them to the logits."""

    owner: GrammarMasks
    logits_rows: list[int]  # the logits row of each constrained row, in mask order
    identity: bool  # the constrained rows are all the logits rows, in order
    filled: Future

    def apply(self, logits: torch.Tensor) -> None:
        """Add each constrained row's bias to its logits row (in place, under inference mode)."""
        waited = time.perf_counter()
        fill_s = self.filled.result()
        start = time.perf_counter()
        num_rows = len(self.logits_rows)
        bias = self.owner.host_bias[:num_rows, :logits.shape[1]]
        bias = bias.to(logits.device, logits.dtype, non_blocking=True)
        with torch.inference_mode():
            if self.identity:
                logits.add_(bias)
            else:
                logits.index_add_(0, torch.tensor(self.logits_rows, device=logits.device), bias)
        self.owner.timings.append(MaskTiming(num_rows, fill_s, start - waited, time.perf_counter() - start))


class GrammarMasks:
    """Fills and applies the masks of constrained rows for one engine (vocabulary width `vocab_size`)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.pin = device.type == "cuda"
        self.host_bias = torch.empty((0, vocab_size), dtype=torch.float32)
        self._bits = np.empty((0, self.num_words), dtype=np.int32)
        self._worker: ThreadPoolExecutor | None = None
        self.timings: deque[MaskTiming] = deque(maxlen=100_000)

    def start(self, rows: Iterable[ScheduledRow]) -> PendingMasks | None:
        """Begin filling the masks of the constrained rows among a step's `rows` (None if there are none).
        A verify row (speculative decoding) has a logits row per place of its draft, and a mask each."""
        matchers: list[tuple[LLMatcher, list[int]]] = []  # each constrained row's matcher and draft
        logits_rows: list[int] = []
        logits_row = 0
        for row in rows:
            chunk = row.chunk
            if not chunk.needs_logits:
                continue
            num_places = 1 + chunk.num_draft_tokens
            grammar = row.seq.grammar
            if grammar is not None:
                matchers.append((grammar.matcher, chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens:]))
                logits_rows.extend(range(logits_row, logits_row + num_places))
            logits_row += num_places
        if not matchers:
            return None
        self._reserve(len(logits_rows))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="localserve-masks")
        filled = self._worker.submit(self._fill, matchers, len(logits_rows))
        return PendingMasks(self, logits_rows, len(logits_rows) == logits_row, filled)

    def _reserve(self, num_rows: int) -> None:
        if num_rows <= len(self._bits):
            return
        capacity = max(num_rows, 2 * len(self._bits))
        self._bits = np.empty((capacity, self.num_words), dtype=np.int32)
        self.host_bias = torch.empty((capacity, self.vocab_size), dtype=torch.float32, pin_memory=self.pin)

    def _fill(self, matchers: list[tuple[LLMatcher, list[int]]], num_rows: int) -> float:
        """On the worker: each place's mask into its row of bits, then the bits into the bias rows. A draft's
        places are masked by the matcher walked through the draft's allowed tokens, then rolled back: the
        sequence's matcher is advanced only by the tokens its verification keeps (engine/stop_rules.py).
        A place past a forbidden drafted token repeats the last mask: it is never read (the token is
        rejected where it was drafted)."""
        start = time.perf_counter()
        bits = self._bits[:num_rows]
        index = 0
        for matcher, draft in matchers:
            num_allowed = matcher.validate_tokens(draft) if draft else 0
            for place in range(len(draft) + 1):
                if 0 < place <= num_allowed:
                    matcher.consume_token(draft[place - 1])
                row = bits[index]
                matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                index += 1
            if num_allowed:
                matcher.rollback(num_allowed)
        disallowed = np.unpackbits((~bits).view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
        np.multiply(disallowed, NEG_INF_BITS, out=self.host_bias[:num_rows].numpy().view(np.uint32),
                    casting="unsafe")
        return time.perf_counter() - start
