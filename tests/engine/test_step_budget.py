"""The step budget in time: the cost model learnt from measured steps, and the prefill a step takes within
it, beside the scheduler's token budget (no model: the measurements are numbers given to the model)."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from localserve.engine.config import SchedulerConfig
from localserve.engine.scheduler import Scheduler
from localserve.engine.step_budget import (
    MARGIN_STEPS,
    MAX_MARGIN,
    MIN_MARGIN,
    MIN_MARGIN_STEPS,
    MIN_USUAL_GAP_STEPS,
    UNLEARNT_PREFILL_TOKENS,
    USUAL_GAP_STEPS,
    StepCostModel,
    StepShape,
    StepTimeBudget,
)
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


def usual_gap(steps: list[tuple[float, int]]) -> float:
    """The median gap over the rows of decode-only steps, each row counted once (the ITL's view)."""
    gaps = sorted(duration for duration, rows in steps for _ in range(rows))
    return gaps[(len(gaps) - 1) // 2]


def decode_steps(budget: StepTimeBudget, rows: int, duration_s: float, count: int) -> list[tuple[float, int]]:
    """`count` steps of `rows` decodes, measured as the scheduler shows them (the budget, then the cost)."""
    shape = StepShape(rows, 0, 0, rows * 10)
    for _ in range(count):
        budget.start_step(shape)
        budget.observe(shape, duration_s)
        budget.cost.observe(shape, duration_s)
    return [(duration_s, rows)] * count


def trained_budget(min_prefill_tokens: int = 1, steps: int = 200) -> StepTimeBudget:
    """A budget over trained(), shown decode steps of 1-32 rows as the cost model was."""
    budget = StepTimeBudget(trained(), None, min_prefill_tokens)
    rng = random.Random(5)
    for _ in range(steps):
        rows = rng.randint(1, 32)
        shape = StepShape(rows, 0, 0, rows * rng.uniform(2, 40))
        budget.observe(shape, law(shape))
    return budget


def test_the_budget_leaves_a_step_twice_a_streams_usual_gap():
    budget = trained_budget()
    decodes = StepShape(4, 0, 0, 40)
    tokens = budget.prefill_tokens(decodes, decodes)
    usual = budget.usual_gap_s()
    assert usual is not None and usual > law(decodes)  # it has seen decode steps of 1-32 rows
    # The prefill chunk's row and tokens fill what twice the usual gap leaves beside the decodes.
    expected = (2 * usual - law(decodes) - PER_ROW) / PER_TOKEN
    assert tokens == pytest.approx(expected, abs=1)
    assert budget.last_limit_s == pytest.approx(2 * usual)
    with_drafts = StepShape(4, 0, 8, 40)  # drafted tokens are in the step already: less is left
    assert budget.prefill_tokens(decodes, with_drafts) == pytest.approx(expected - 8 * PER_DRAFT / PER_TOKEN, abs=1)


def test_a_step_of_more_rows_than_usual_gets_twice_the_usual_gap_not_twice_its_own_decodes():
    """Seen on the dev CPU: 16 streams under Poisson arrivals run 1-10 at a time; a step of 10 decodes
    with a chunk as long again held 10 streams at 3-4x their usual gap, the inter-token latency's tail."""
    cost = StepCostModel()
    budget = StepTimeBudget(cost, None, min_prefill_tokens=16)
    steps = decode_steps(budget, 4, 0.06, 100) + decode_steps(budget, 16, 0.15, 20)  # 400 rows at 60 ms, 320 at 150
    for tokens in (50, 100, 150):  # 4 decodes, a chunk's row (8 ms) and its tokens (1 ms each)
        cost.observe(StepShape(5, tokens, 0, 40 + tokens / 16), 0.068 + tokens * 1e-3)
    assert cost.ready
    assert budget.usual_gap_s() == pytest.approx(0.06) == pytest.approx(usual_gap(steps))
    many = StepShape(16, 0, 0, 160)
    assert cost.estimate_decodes(many) == pytest.approx(0.15, rel=0.05)
    assert budget.prefill_tokens(many, many) == 16  # its decodes alone take more than 2 x 60 ms: the floor
    assert budget.last_limit_s == pytest.approx(0.12)
    few = StepShape(4, 0, 0, 40)
    left = 0.12 - cost.estimate(few) - cost.per_row_s
    assert budget.prefill_tokens(few, few) == int(left / cost.per_prefill_token_s) > 16


def test_the_usual_gap_weighs_each_step_by_its_rows():
    budget = StepTimeBudget(StepCostModel(), None, 16)
    # Ten steps of 1 row at 50 ms and ten of 10 rows at 100 ms: 10 rows waited 50 ms, 100 rows 100 ms.
    steps = decode_steps(budget, 1, 0.05, 10) + decode_steps(budget, 10, 0.1, 10)
    assert budget.usual_gap_s() == pytest.approx(0.1) == pytest.approx(usual_gap(steps))


def test_a_step_with_prefill_counts_its_decodes_estimated_time_not_its_own():
    """When prompts keep arriving every step carries a chunk: measured decode-only steps would run out, and
    a usual gap from the quiet minutes before would hold the limit under the decodes now running (seen on
    the dev CPU: 12 decodes of 330 ms under a limit of 450 ms, every prompt prefilled 16 tokens a step)."""
    budget = trained_budget()
    cost = budget.cost
    decodes = StepShape(20, 0, 0, 200)
    for _ in range(USUAL_GAP_STEPS):
        budget.start_step(decodes)
        budget.prefill_tokens(decodes, decodes)
        with_chunk = StepShape(21, 100, 0, 206)
        budget.observe(with_chunk, 10.0)  # a slow step: its prefill's time is not a stream's usual gap
    assert budget.usual_gap_s() == pytest.approx(cost.estimate_decodes(decodes))
    budget.observe(StepShape(3, 0, 2, 30), 5.0)  # drafts, in a step not started: its decodes are unknown
    assert budget.usual_gap_s() == pytest.approx(cost.estimate_decodes(decodes))
    verify = StepShape(3, 0, 0, 30)
    for _ in range(USUAL_GAP_STEPS):  # steps of drafts to verify: their rows wait for the decodes' estimate
        budget.start_step(verify)
        budget.observe(StepShape(3, 0, 6, 30), 5.0)
    assert budget.usual_gap_s() == pytest.approx(cost.estimate_decodes(verify))


def test_the_usual_gap_needs_eight_steps_and_counts_the_last_128():
    budget = StepTimeBudget(StepCostModel(), None, 16)
    decode_steps(budget, 2, 0.05, MIN_USUAL_GAP_STEPS - 1)
    assert budget.usual_gap_s() is None  # 7: the step's own decodes set the limit
    decode_steps(budget, 2, 0.05, 1)
    assert budget.usual_gap_s() == pytest.approx(0.05)  # 8
    decode_steps(budget, 2, 0.2, USUAL_GAP_STEPS - 1)
    assert budget.usual_gap_s() == pytest.approx(0.2)
    budget = StepTimeBudget(StepCostModel(), None, 16)
    decode_steps(budget, 200, 0.05, 1)
    decode_steps(budget, 1, 0.2, USUAL_GAP_STEPS - 1)  # the 200 rows at 50 ms are the oldest of the last 128
    assert budget.usual_gap_s() == pytest.approx(0.05)
    decode_steps(budget, 1, 0.2, 1)  # and now the 129th: gone
    assert budget.usual_gap_s() == pytest.approx(0.2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 64), st.floats(1e-3, 1.0)), max_size=300))
@example([(1, 0, 0.01)] * (MIN_USUAL_GAP_STEPS - 1))
@example([(1, 0, 0.01)] * USUAL_GAP_STEPS + [(5, 0, 0.5)])
@example([(2, 0, 0.01)] * 5 + [(2, 50, 0.1)] * 3 + [(2, 0, 0.01)] * 5 + [(3, 20, 0.5)] * 200)
def test_the_usual_gap_is_the_row_weighted_median_of_the_recent_steps_decodes(steps):
    """Steps as the scheduler runs them: the budget is asked for each step's prefill, then shown its time."""
    budget = StepTimeBudget(StepCostModel(), None, min_prefill_tokens=16)
    cost = budget.cost
    gaps = []
    for rows, prefill_tokens, duration in steps:
        decodes = StepShape(rows, 0, 0, rows * 4)
        estimated = cost.estimate_decodes(decodes) if cost.ready else None
        budget.start_step(decodes)
        if prefill_tokens:
            budget.prefill_tokens(decodes, decodes)
        shape = StepShape(rows + (prefill_tokens > 0), prefill_tokens, 0, rows * 4 + prefill_tokens / 16)
        budget.observe(shape, duration)
        cost.observe(shape, duration)
        if not prefill_tokens:
            gaps.append((duration, rows))
        elif estimated is not None:
            gaps.append((estimated, rows))
    recent = gaps[-USUAL_GAP_STEPS:]
    expected = usual_gap(recent) if len(recent) >= MIN_USUAL_GAP_STEPS else None
    assert budget.usual_gap_s() == (pytest.approx(expected) if expected is not None else None)


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
    budget = trained_budget()
    bm = BlockManager(64, 16)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512), bm, step_budget=budget)
    running = [run(scheduler, make_request(i, list(range(10 + i, 30 + i)), [[5, 6, 7]], max_tokens=50))
               for i in range(4)]
    scheduler.add(make_request(4, list(range(100, 400)), [[]], max_tokens=20))  # a 300-token prompt arrives
    batch = scheduler.schedule()
    context = sum(len(request.seqs[0].token_ids) for request in running)
    decodes = StepShape(4, 0, 0, context / 16)
    allowed = round((2 * budget.usual_gap_s() - law(decodes) - PER_ROW) / PER_TOKEN)
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


def test_the_margin_is_the_95th_percentile_of_measured_over_estimated_prefill_steps():
    cost = trained()
    budget = StepTimeBudget(cost, None, min_prefill_tokens=1)
    step = StepShape(8, 100, 0, 80)
    assert budget.margin == 1.0
    for _ in range(MIN_MARGIN_STEPS - 1):
        budget.observe(step, 1.5 * cost.estimate(step))
    assert budget.margin == 1.0  # 7 steps: too few to tell
    budget.observe(step, 1.5 * cost.estimate(step))
    assert budget.margin == pytest.approx(1.5)  # 8
    budget = StepTimeBudget(cost, None, min_prefill_tokens=1)
    ratios = [1 + i / 100 for i in range(20)]  # 1.00 .. 1.19: the 19th of 20 is the 95th percentile
    for ratio in random.Random(3).sample(ratios, len(ratios)):
        budget.observe(step, ratio * cost.estimate(step))
    assert budget.margin == pytest.approx(1.18)
    budget.observe(StepShape(8, 0, 0, 80), 9.0)  # a decode-only step: the limit does not shape it
    budget.observe(StepShape(1, 100, 0, 8), 9.0)  # a prompt alone: no decodes to keep steady
    assert budget.margin == pytest.approx(1.18)


def test_the_margin_keeps_to_its_bounds_and_counts_the_last_64_steps():
    cost = trained()
    step = StepShape(8, 100, 0, 80)
    budget = StepTimeBudget(cost, None, min_prefill_tokens=1)
    for _ in range(MARGIN_STEPS):
        budget.observe(step, 5 * cost.estimate(step))  # another process held the core
    assert budget.margin == MAX_MARGIN
    for _ in range(MARGIN_STEPS - 4):
        budget.observe(step, 0.1 * cost.estimate(step))
    assert budget.margin == MAX_MARGIN  # 4 slow steps of the last 64: the 61st of 64 is slow
    budget.observe(step, 0.1 * cost.estimate(step))
    assert budget.margin == MIN_MARGIN  # 3 left: above the 95th percentile


def test_a_step_is_fitted_to_the_limit_over_the_margin():
    """On the dev CPU steps with a prefill chunk ran over their estimate often enough that, aimed at twice
    the usual gap on average, their tail passed it (bench_serving's p99 inter-token gap 2.1-2.5x the median)."""
    cost = trained()
    budget = StepTimeBudget(cost, None, min_prefill_tokens=1)
    decodes = StepShape(4, 0, 0, 40)
    plain = budget.prefill_tokens(decodes, decodes)
    limit = budget.last_limit_s
    for _ in range(MARGIN_STEPS):
        step = StepShape(5, 64, 0, 44)
        budget.observe(step, 1.25 * cost.estimate(step))
    assert budget.margin == pytest.approx(1.25)
    tokens = budget.prefill_tokens(decodes, decodes)
    assert budget.last_limit_s == pytest.approx(limit)  # the limit itself stays
    assert tokens == pytest.approx((limit / 1.25 - law(decodes) - PER_ROW) / PER_TOKEN, abs=1) and tokens < plain
    # The scheduler shows the budget each step before the cost model learns from it.
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512), BlockManager(64, 16),
                          step_budget=StepTimeBudget(trained(), None, min_prefill_tokens=1))
    for i in range(3):
        run(scheduler, make_request(i, list(range(10 + i, 30 + i)), [[5, 6, 7]], max_tokens=50))
    scheduler.add(make_request(3, list(range(100, 400)), [[]], max_tokens=20))
    batch = scheduler.schedule()
    shape = batch.shape(16)
    assert shape.num_prefill_tokens > 0 and len(batch.rows) == 4
    expected = 1.5 * scheduler.step_cost.estimate(shape)
    for _ in range(MIN_MARGIN_STEPS):
        scheduler.observe_step(batch, expected)
    assert scheduler.step_budget.margin > 1.3  # near 1.5: the estimate moves toward what it measured


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 200), st.floats(0.01, 10.0)), max_size=150))
@example([(4, 64, 1.2)] * (MIN_MARGIN_STEPS - 1))
@example([(4, 64, 3.0)] * 4 + [(4, 64, 1.0)] * (MARGIN_STEPS - 4))
def test_the_margin_is_the_clamped_quantile_of_the_recent_prefill_steps(steps):
    cost = trained()
    budget = StepTimeBudget(cost, None, min_prefill_tokens=1)
    ratios = []
    for rows, prefill_tokens, ratio in steps:
        shape = StepShape(rows, prefill_tokens, 0, rows * 4)
        budget.observe(shape, ratio * cost.estimate(shape))
        if prefill_tokens and rows >= 2:
            ratios.append(ratio)
    recent = ratios[-MARGIN_STEPS:]
    if len(recent) < MIN_MARGIN_STEPS:
        assert budget.margin == 1.0
        return
    # The smallest of the ratios that at least 95% of them are at or below, clamped.
    quantile = min(r for r in recent if sum(other <= r for other in recent) >= 0.95 * len(recent))
    assert budget.margin == pytest.approx(min(MAX_MARGIN, max(MIN_MARGIN, quantile)))


def test_the_scheduler_starts_every_step_with_the_budget_and_asks_it_only_with_prompt_tokens_to_place():
    budget = trained_budget()
    asked = []
    prefill_tokens = budget.prefill_tokens
    budget.prefill_tokens = lambda decodes, now: asked.append(decodes.num_rows) or prefill_tokens(decodes, now)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512), BlockManager(64, 16),
                          step_budget=budget)
    for i in range(3):
        run(scheduler, make_request(i, list(range(10 + i, 30 + i)), [[5, 6, 7]], max_tokens=50))
    before = budget.usual_gap_s()
    batch = scheduler.schedule()  # decodes only, nothing waiting: the budget is not asked
    assert asked == [] and query_lens(batch) == [1, 1, 1]
    for _ in range(USUAL_GAP_STEPS):  # and each such step counts toward the usual gap
        scheduler.observe_step(batch, 0.5)
    assert before != pytest.approx(0.5) and budget.usual_gap_s() == pytest.approx(0.5)
    scheduler.add(make_request(3, list(range(100, 400)), [[]], max_tokens=20))
    scheduler.mark_computed(batch)
    for request in scheduler.queues.running:
        request.seqs[0].token_ids.append(9)  # what the step sampled
    batch = scheduler.schedule()
    assert asked == [3] and query_lens(batch)[:3] == [1, 1, 1] and query_lens(batch)[3] > 0
    assert budget.last_limit_s == pytest.approx(2 * 0.5)  # twice the usual gap it was shown
