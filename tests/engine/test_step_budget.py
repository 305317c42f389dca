"""The step budget in time: the cost model learnt from measured steps, and the prefill a step takes within
it, beside the scheduler's token budget (no model: the measurements are numbers given to the model)."""

from __future__ import annotations

import random

import pytest

from localserve.engine.config import SchedulerConfig
from localserve.engine.scheduler import Scheduler
from localserve.engine.step_budget import UNLEARNT_PREFILL_TOKENS, StepCostModel, StepShape, StepTimeBudget
from localserve.kv.block_manager import BlockManager
from tests.helpers.scheduler_states import make_request, query_lens, run

# A CPU-like law: 5 ms a step, 2 ms a row, 1 ms a prompt token, 3 ms a drafted token, 0.02 ms a block of context.
FIXED, PER_ROW, PER_TOKEN, PER_DRAFT, PER_BLOCK = 5e-3, 2e-3, 1e-3, 3e-3, 2e-5


def law(shape: StepShape) -> float:
    return (FIXED + PER_ROW * shape.num_rows + PER_TOKEN * shape.num_prefill_tokens
            + PER_DRAFT * shape.num_draft_tokens + PER_BLOCK * shape.num_context_blocks)


def trained(steps: int = 200, seed: int = 0, noise: float = 0.0) -> StepCostModel:
    """A cost model that has seen decode steps of 1-32 rows, some with a prefill chunk or a draft."""
    rng = random.Random(seed)
    cost = StepCostModel()
    for _ in range(steps):
        rows = rng.randint(1, 32)
        shape = StepShape(rows, rng.choice([0, 0, rng.randint(1, 256)]), rng.choice([0, rng.randint(1, 4 * rows)]),
                          rows * rng.uniform(2, 40))
        cost.observe(shape, law(shape) * (1 + rng.uniform(-noise, noise)))
    return cost


def test_the_cost_model_recovers_a_linear_law_from_measured_steps():
    cost = trained()
    assert cost.ready
    assert cost.per_prefill_token_s == pytest.approx(PER_TOKEN, rel=1e-2)
    assert cost.per_draft_token_s == pytest.approx(PER_DRAFT, rel=1e-2)
    assert cost.per_row_s == pytest.approx(PER_ROW, rel=1e-2)
    assert cost.per_block_s == pytest.approx(PER_BLOCK, rel=1e-2)
    shape = StepShape(16, 64, 20, 300)
    assert cost.estimate(shape) == pytest.approx(law(shape), rel=1e-3)


def test_the_cost_model_is_not_ready_before_it_has_seen_prefill_chunks():
    cost = StepCostModel()
    for rows in range(1, 50):
        shape = StepShape(rows, 0, rows // 2, rows * 4)
        cost.observe(shape, law(shape))
    assert not cost.ready  # a prompt token's cost is not known from decodes and drafts alone
    for tokens in (40, 80, 120):
        shape = StepShape(4, tokens, 0, 20)
        cost.observe(shape, law(shape))
    assert cost.ready


def test_the_cost_model_follows_a_slower_device_and_shrugs_off_a_stall():
    cost = trained(noise=0.05)
    shape = StepShape(16, 0, 0, 300)
    before = cost.estimate(shape)
    cost.observe(shape, 100 * law(shape))  # another process held the core for this one step
    assert cost.estimate(shape) < 1.5 * before
    rng = random.Random(1)
    for _ in range(300):  # the machine now runs everything twice as slowly
        rows = rng.randint(1, 32)
        step = StepShape(rows, rng.choice([0, 64]), rng.choice([0, rows]), rows * rng.uniform(2, 40))
        cost.observe(step, 2 * law(step))
    assert cost.estimate(shape) == pytest.approx(2 * law(shape), rel=0.05)


def test_the_budget_leaves_a_step_about_twice_its_decodes_alone():
    cost = trained()
    budget = StepTimeBudget(cost, None, min_prefill_tokens=1)
    decodes = StepShape(16, 0, 0, 160)
    tokens = budget.prefill_tokens(decodes, decodes)
    # The prefill chunk's row and tokens fill what twice the decodes leave beside the decodes.
    expected = (2 * law(decodes) - law(decodes) - PER_ROW) / PER_TOKEN
    assert tokens == pytest.approx(expected, abs=1)
    assert budget.last_limit_s == pytest.approx(2 * law(decodes), rel=1e-3)
    with_drafts = StepShape(16, 0, 8, 160)  # drafted tokens are in the step already: less is left
    assert budget.prefill_tokens(decodes, with_drafts) == pytest.approx(expected - 8 * PER_DRAFT / PER_TOKEN, abs=1)


def test_a_fixed_limit_and_the_floor_that_keeps_a_prompt_moving():
    cost = trained()
    decodes = StepShape(8, 0, 0, 80)
    fixed = StepTimeBudget(cost, 0.1, min_prefill_tokens=16)
    assert fixed.prefill_tokens(decodes, decodes) == pytest.approx((0.1 - law(decodes) - PER_ROW) / PER_TOKEN, abs=1)
    tight = StepTimeBudget(cost, 0.001, min_prefill_tokens=16)  # less than the decodes alone take
    assert tight.prefill_tokens(decodes, decodes) == 16


def test_no_limit_without_decodes_to_keep_steady_and_small_chunks_before_the_cost_is_learnt():
    budget = StepTimeBudget(trained(), None, min_prefill_tokens=16)
    assert budget.prefill_tokens(StepShape(0, 0, 0, 0), StepShape(0, 0, 0, 0)) is None
    assert StepTimeBudget(StepCostModel(), None, 16).prefill_tokens(StepShape(0, 0, 0, 0), StepShape(0, 0, 0, 0)) \
        is None
    # Unlearnt, beside decodes: chunks of UNLEARNT_PREFILL_TOKENS (a 1,536-token prompt's first chunks of 512
    # stalled 16 streams for 3 s each in bench_interference.py before the fit was ready).
    decodes = StepShape(4, 0, 0, 8)
    assert StepTimeBudget(StepCostModel(), None, 16).prefill_tokens(decodes, decodes) == UNLEARNT_PREFILL_TOKENS
    assert StepTimeBudget(StepCostModel(), None, 128).prefill_tokens(decodes, decodes) == 128


def test_the_scheduler_prefills_what_the_time_budget_leaves_beside_the_decodes():
    cost = trained()
    bm = BlockManager(64, 16)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512), bm,
                          step_budget=StepTimeBudget(cost, None, min_prefill_tokens=1))
    running = [run(scheduler, make_request(i, list(range(10 + i, 30 + i)), [[5, 6, 7]], max_tokens=50))
               for i in range(4)]
    scheduler.add(make_request(4, list(range(100, 400)), [[]], max_tokens=20))  # a 300-token prompt arrives
    batch = scheduler.schedule()
    context = sum(len(request.seqs[0].token_ids) for request in running)
    decodes = StepShape(4, 0, 0, context / 16)
    allowed = round((2 * law(decodes) - law(decodes) - PER_ROW) / PER_TOKEN)
    assert query_lens(batch)[:4] == [1, 1, 1, 1]
    assert query_lens(batch)[4] == pytest.approx(allowed, abs=1) and allowed < 300
    assert batch.num_context_tokens == context + query_lens(batch)[4]


def test_the_default_limit_is_twice_the_measured_decodes_where_the_fit_overestimates_them():
    """Every step with 16 decodes and a prefill chunk: the fit cannot tell the fixed cost from the rows'
    (seen on the dev CPU: a 16-row decode step estimated at 2-5x its measured 150 ms, so the limit let
    steps run 4x a decode step). Measured decode-only steps of that many rows bound the estimate."""
    cost = StepCostModel()
    rng = random.Random(2)
    for _ in range(40):
        tokens = rng.randint(20, 100)
        shape = StepShape(17, tokens, 0, 300)
        cost.observe(shape, 0.25 + 0.005 * tokens)  # 150 ms of decodes, 100 ms the chunk's row, 5 ms a token
    decodes = StepShape(16, 0, 0, 300)
    assert cost.ready and cost.estimate(decodes) > 0.2  # extrapolated to no prefill: off
    cost.observe(decodes, 0.15)
    assert cost.estimate_decodes(decodes) == pytest.approx(0.15, rel=0.05)
    budget = StepTimeBudget(cost, None, min_prefill_tokens=16)
    budget.prefill_tokens(decodes, decodes)
    assert budget.last_limit_s == pytest.approx(0.3, rel=0.05)
    assert cost.estimate_decodes(StepShape(8, 0, 0, 100)) == cost.estimate(StepShape(8, 0, 0, 100))  # none measured
