"""The image encoder's time in the step's time budget (engine/step_budget.py). No torch, no model code.

A request's image is a span of its prompt (engine/multimodal.py) whose embeddings the encoder makes on the
engine thread in the step whose prefill chunk first reads it; an image whose embeddings are cached
(`EmbeddingCache`) costs nothing. An encode is no prompt token: the step cost model learns without its time
(engine.py subtracts it), and `EncoderCost` learns it apart, in seconds per image token encoded.

Where a step has a time budget (decodes to keep steady, the cost learnt: `StepTimeBudget.prefill_tokens`),
each prefill chunk that reaches an image not cached and not already encoded by the step is charged the
image's estimated encode time, in prefill-token equivalents (`StepTimeBudget.encode_tokens_per_s`), against
what the budget left (`ImageFit.fit`); the charge lowers the step's token budget for the chunks and
admissions after it (engine/batch.py's filler). The rules:
- An image fits when the chunk's tokens up to the image's end in it, the images charged before it and its own
  charge fit the room left; the first image that does not fit cuts the chunk at its start (the text before
  it still goes; nothing, when the chunk starts inside it), and the image waits for a step with room.
- Never starved: the step's first prefill chunk takes an image that does not fit when the chunk starts at
  or inside it (nothing before it to send first; a whole prompt, without chunked prefill, takes its images
  whenever it is the step's first prefill, as it passes the token budget today). The first running
  sequence with prompt left (else the first admitted) has the step's first prefill chunk and makes progress
  every step (the text before an image, or the image), so every prompt finishes.
- Text after the images charged is trimmed to the room left, never shorter than their end, and never ending
  strictly inside a bidirectional span (engine/batch.py, `span_safe_chunk`).
- Without chunked prefill a prompt runs whole or not at all: one whose images do not fit waits, unless it is
  the step's first prefill.
- With no image, or an image cached, nothing changes: the same chunks as without this module.

Before an encode has been measured an image is estimated at nothing (its first encode is tried, as a
drafted token's before its cost is learnt), and before the step cost is learnt no image is charged (the
prefill is held to `UNLEARNT_PREFILL_TOKENS` then, and the fit is ready after a few steps). Not charged
either: a prompt's last token computed as a decode row (after a prefix hit) inside an image not cached, and
an image the step's other encodes evict from a cache too small for both (chat prompts end in text, and the
cache holds many images).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localserve.engine.sequence import Request

ENCODE_DECAY = 0.7  # each earlier measured encode counts 30% less: the last few images shape the estimate
ENCODE_OUTLIER_MULTIPLE = 3.0  # an encode taking more than this times its estimate counts as this (a stall)


class EncoderCost:
    """Seconds per image token encoded: the measured encodes' seconds over their tokens, each earlier one
    weighing `ENCODE_DECAY` less (one model and encoder per engine: its cost is about linear in the tokens)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._tokens = 0.0
        self.num_observations = 0

    @property
    def seconds_per_token(self) -> float | None:
        """The estimate, or None before an encode was measured."""
        return self._seconds / self._tokens if self._tokens else None

    def estimate(self, num_tokens: int) -> float:
        """The estimated seconds to encode an image of `num_tokens` tokens (0 before any was measured)."""
        per_token = self.seconds_per_token
        return 0.0 if per_token is None else per_token * num_tokens

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Images of `num_tokens` tokens in all were encoded in `seconds` (nothing is learnt from no tokens)."""
        if num_tokens <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        if self.num_observations:
            seconds = min(seconds, ENCODE_OUTLIER_MULTIPLE * self.estimate(num_tokens))
        self._seconds = ENCODE_DECAY * self._seconds + seconds
        self._tokens = ENCODE_DECAY * self._tokens + num_tokens
        self.num_observations += 1


@dataclass(eq=False, slots=True)
class StepImages:
    """One step's time budget for images, in prefill-token equivalents: `time_budget` the step's tokens and
    charges may reach (its tokens when the limit was set plus the prefill the budget allowed), `tokens_per_s`
    what a second of encoding counts as, `charged` the images charged so far, `content_hashes` theirs."""

    time_budget: float
    tokens_per_s: float
    charged: float = 0.0
    content_hashes: set[bytes] = field(default_factory=set)

    def room(self, num_tokens: int) -> float:
        """What is left for a step holding `num_tokens` tokens and the charges so far."""
        return self.time_budget - num_tokens - self.charged

    @property
    def token_limit(self) -> int:
        """The most tokens the step may hold beside its charges: the token budget never passes it."""
        return math.floor(self.time_budget - self.charged)


class ImageFit:
    """Fits prefill chunks' new images to the step's time budget (module doc). `is_cached(content_hash)`
    answers whether an image's embeddings are held (the engine hands it its `EmbeddingCache`'s membership:
    the scheduler asks, it never reads the cache)."""

    def __init__(self, cost: EncoderCost, is_cached: Callable[[bytes], bool]) -> None:
        self.cost = cost
        self.is_cached = is_cached

    def fit(self, step: StepImages, num_batch_tokens: int, first: bool, request: Request, start: int,
            num_tokens: int, chunked: bool) -> int:
        """The length of the request's chunk of `num_tokens` from `start` (as the token budget and the span rule
        made it), in a step holding `num_batch_tokens` (`first`: no prefill chunk yet), once its new images
        are charged to `step` (module doc); charges them when the length is not 0. The caller keeps the
        chunk's end outside bidirectional spans (a trimmed chunk may end inside one after the images)."""
        end = start + num_tokens
        room = step.room(num_batch_tokens)
        charges: dict[bytes, float] = {}
        through = 0  # the chunk's tokens up to the last charged image's end in it
        cut = None
        for offset, span_end, content_hash in request.image_spans:
            if offset >= end:
                break
            if span_end <= start or content_hash in charges or content_hash in step.content_hashes \
                    or self.is_cached(content_hash):
                continue
            cost = self.cost.estimate(span_end - offset) * step.tokens_per_s
            reach = min(span_end, end) - start
            if reach + sum(charges.values()) + cost > room and not (first and (offset <= start or not chunked)):
                cut = max(offset, start) - start
                break
            charges[content_hash] = cost
            through = reach
        charged = sum(charges.values())
        if not chunked:
            if cut is not None or (num_tokens + charged > room and not first):
                return 0
        else:
            if cut is not None:
                num_tokens = cut
            if charges and num_tokens + charged > room:  # text after the images, to what is left
                num_tokens = max(through, min(num_tokens, math.floor(room - charged)))
        if num_tokens > 0 and charges:
            step.charged += charged
            step.content_hashes.update(charges)
        return num_tokens
