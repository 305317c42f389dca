"""One sequence's speculative decoding: its recent acceptance, the draft of the step in flight, its totals.

Kept apart from engine/speculation.py so that `Sequence` can hold it without importing the scheduler's
side of speculation (which imports the sequences). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The acceptance estimate starts at 1/2: one accepted token in two tried, which the first verifications
# outweigh within a few steps.
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0
DECAY = 0.9  # per verification: the last ~10 count most, so the estimate follows the text being written
IDLE_DECAY = 0.998  # per step without a draft: the estimate drifts back to the prior: a draft is tried now and then


@dataclass(slots=True)
class SpecState:
    """Per sequence: how often its drafted tokens are accepted (the drafter's per-token acceptance, decayed),
    the draft of the current step (and the drafter's probabilities of it, for temperature > 0), and totals."""

    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED
    draft: list[int] = field(default_factory=list)  # drafted tokens in flight this step ([] between steps)
    draft_probs: object | None = None  # the drafter's distributions of them [len(draft), V]; None: point masses
    num_drafts: int = 0  # verify rows
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance(self) -> float:
        """The estimated probability that a drafted token is accepted, given those before it were."""
        return self.accepted / self.tried

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """A verification: `num_accepted` of `num_drafted` tokens accepted. Each accepted token was one try;
        the first rejected one is a try too; the tokens after it were never judged."""
        tried = num_accepted + (num_accepted < num_drafted)
        self.accepted = DECAY * self.accepted + num_accepted
        self.tried = DECAY * self.tried + tried
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted

    def idle(self) -> None:
        """A decode step without a draft: the estimate moves toward the prior."""
        self.accepted = PRIOR_ACCEPTED + IDLE_DECAY * (self.accepted - PRIOR_ACCEPTED)
        self.tried = PRIOR_TRIED + IDLE_DECAY * (self.tried - PRIOR_TRIED)
