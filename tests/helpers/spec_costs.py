"""A step cost for the speculation planner that does not depend on the machine (engine/speculation.py)."""

from __future__ import annotations


class FixedStepCost:
    """Every step takes `step_s` by the fit and as measured, a drafted token `per_draft_token_s`. The defaults
    make every drafted token worth its place: a plan drafts K tokens whenever the budget and blocks allow."""

    ready = True

    def __init__(self, per_draft_token_s: float = 1e-9, step_s: float = 1e3) -> None:
        self.per_draft_token_s, self.step_s = per_draft_token_s, step_s

    def estimate(self, shape) -> float:
        return self.step_s

    def estimate_decodes(self, shape) -> float:
        return self.step_s
