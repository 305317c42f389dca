"""Step and encoder costs that do not depend on the machine, for tests of the step's time budget
(engine/step_budget.py, engine/encode_budget.py): a learnt cost that is a fixed linear law, a budget and an
encoder cost that learn nothing from the measured steps."""

from __future__ import annotations

from localserve.engine.encode_budget import EncoderCost
from localserve.engine.step_budget import StepShape, StepTimeBudget


class LinearStepCost:
    """A learnt step cost (what StepTimeBudget reads of a StepCostModel) that is a linear law exactly: `fixed`
    a step, `per_row_s` a row, `per_prefill_token_s` a prompt token past each chunk's first, `per_draft_token_s`
    a drafted token; measured steps teach it nothing."""

    ready = True
    per_block_s = 0.0

    def __init__(self, fixed: float, per_row_s: float, per_prefill_token_s: float,
                 per_draft_token_s: float = 3e-3) -> None:
        self.fixed, self.per_row_s = fixed, per_row_s
        self.per_prefill_token_s, self.per_draft_token_s = per_prefill_token_s, per_draft_token_s

    def estimate(self, shape: StepShape) -> float:
        return (self.fixed + self.per_row_s * shape.num_rows + self.per_prefill_token_s * shape.num_prefill_tokens
                + self.per_draft_token_s * shape.num_draft_tokens)

    def estimate_decodes(self, shape: StepShape) -> float:
        return self.estimate(shape)

    def observe(self, shape: StepShape, duration_s: float) -> None:
        """Nothing is learnt."""


class FrozenTimeBudget(StepTimeBudget):
    """A step time budget whose margin and usual gap stay as they are whatever the steps measure."""

    def observe(self, shape: StepShape, duration_s: float) -> None:
        """Nothing is learnt."""


class FixedEncoderCost(EncoderCost):
    """An image token's encode takes `seconds_per_token`, whatever the encodes measure."""

    def __init__(self, seconds_per_token: float) -> None:
        super().__init__()
        super().observe(1, seconds_per_token)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Nothing is learnt."""
