"""What passes between the scheduler and a drafter: the scheduler decides which sequences draft and how many
tokens (engine/speculation.py), the engine has the drafter compute them between `Scheduler.schedule()` and
the forward pass, and hands the drafts back (`Scheduler.add_drafts`). No torch: a draft model's drafter
(engine/draft_model.py) runs its forward passes behind the `Drafter` interface, outside the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Protocol

from localserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class DraftQuery:
    """What a drafter is asked for one sequence: up to `max_tokens` tokens to follow `token_ids` (its
    prompt and output, the last one sampled and not yet computed)."""

    seq_id: int
    token_ids: SequenceABC[int]
    prompt_len: int
    max_tokens: int
    params: SamplingParams


@dataclass(slots=True)
class Draft:
    """Tokens a drafter proposes, and (for temperature > 0, from a model) its probabilities of them: one
    distribution over the vocabulary per drafted token, on the target's device; None: point masses."""

    token_ids: list[int]
    probs: object | None = None


class Drafter(Protocol):
    """Proposes drafts (engine/ngram_drafter.py, engine/draft_model.py)."""

    def propose(self, queries: list[DraftQuery]) -> list[Draft]:
        """One draft per query, each of at most its `max_tokens` tokens (maybe none)."""
        ...

    def release(self, seq_id: int) -> None:
        """The sequence has finished: forget what is kept for it (bookkeeping only, no model call)."""
        ...


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """The drafts a step's schedule asks for: `drafter` is to propose one draft per query, in order."""

    drafter: Drafter
    queries: list[DraftQuery]
