"""A step's cost in time, learnt from the steps as they run, and the prefill a step may take within a time
budget. No torch: the measurements come in as numbers (engine/engine.py times each step).

A budget counted in tokens cannot fit both a CPU and a GPU: 512 prompt tokens cost a CPU several decode
steps and a GPU next to nothing. So the scheduler asks `StepTimeBudget` how many prefill tokens a step
may add to its decodes: as many as keep the step's estimated time within `max_step_ms`, by default twice
(`DECODE_MULTIPLE`) a stream's usual gap, so that an arriving prompt stretches every stream's gap to at
most about twice its usual. The usual gap is the median, over the rows of the recent steps, of their
decodes' time (`StepTimeBudget.usual_gap_s`). Not twice the step's own decodes: a step of more rows than
usual is longer than usual already, and a prefill chunk doubling it stretches the most streams at once
past twice their usual gap (the inter-token latency's tail). And the limit is met by the measured steps,
not by their estimates on average: a step's estimate is fitted to the limit over the 95th percentile of
how far recent steps with prefill overran theirs (`StepTimeBudget.margin`). `max_num_batched_tokens`
stays an upper bound. The trade-off is the time to first token: a prompt arriving among running streams
is prefilled in chunks of what the budget leaves (docs/BENCHMARKS.md, "Step budget in time", has the figures).

An image's encode runs in the step whose prefill chunk first reads it, and is counted in the same budget:
the cost model learns the forward pass alone (the engine leaves the encoder's and the drafter's time out of
what it is shown), the encoder's cost is learnt apart in seconds per image token (engine/encode_budget.py,
`EncoderCost`), and a chunk reaching an image whose embeddings are not cached is charged its estimated
encode in prefill tokens (`encode_tokens_per_s`) against what `prefill_tokens` allowed: an image that does
not fit waits for a step with room (the chunk stops before it), but as the step's first prefill chunk it goes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# The features are scaled to about 1 for a typical step, so that one prior fits every coefficient.
FEATURE_SCALES = (1.0, 16.0, 64.0, 16.0, 256.0)  # constant, rows, prefill tokens, drafted tokens, context blocks
NUM_FEATURES = len(FEATURE_SCALES)
FORGETTING = 0.98  # each older step counts 2% less: about the last 50 steps shape the fit
PRIOR_VARIANCE = 1.0  # of each scaled coefficient, in s^2: vague next to step times of ms to s
MAX_TRACE = 1e4  # the forgetting pauses while the fit is this uncertain (no wind-up between prefills)
MIN_OBSERVATIONS = 8
MIN_PREFILL_STEPS = 3  # steps with prefill chunks, which tell a prompt token's cost from a row's
OUTLIER_MULTIPLE = 3.0  # a step taking more than this times its estimate counts as this (another process ran)
DECODE_MULTIPLE = 2.0  # the default limit: this times a stream's usual gap
# Beside decodes, before the fit is ready, a step prefills at most this many tokens: a 1,536-token prompt
# arriving among 16 streams, prefilled in 512-token chunks while unlearnt, stalled them 3 s a step on the
# dev CPU (bench_interference.py); 64 keeps such a step near twice a decode step there, and the fit learns.
UNLEARNT_PREFILL_TOKENS = 64
DECODE_ONLY_DECAY = 0.8  # the measured decode-only steps of a row count: a running average of the last few
USUAL_GAP_STEPS = 128  # the recent steps with decodes a stream's usual gap is the median of
MIN_USUAL_GAP_STEPS = 8  # fewer, and a step's limit is twice its own decodes
# The limit is met by the measured steps, not only by their estimates: the estimate a step's prefill is fitted
# to is the limit over this quantile of measured / estimated time of the recent steps with prefill.
MARGIN_STEPS = 64
MARGIN_QUANTILE = 0.95
MIN_MARGIN_STEPS = 8
MIN_MARGIN, MAX_MARGIN = 0.5, 2.0
MIN_COST_S = 1e-6  # a coefficient the fit puts at or below 0 (noise) is taken as this


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's time is modelled on: its rows (sequences; each row's first token included), the tokens of
    its prefill chunks past each chunk's first, its drafted tokens (verify rows past their first), and the KV
    it reads (the rows' context tokens over the block size). A drafted token costs more than a prompt token
    on a CPU: a few more rows of a small matrix product, where a prompt chunk fills the product well."""

    num_rows: int
    num_prefill_tokens: int
    num_draft_tokens: int
    num_context_blocks: float

    def features(self) -> tuple[float, ...]:
        values = (1.0, self.num_rows, self.num_prefill_tokens, self.num_draft_tokens, self.num_context_blocks)
        return tuple(value / scale for value, scale in zip(values, FEATURE_SCALES))


class StepCostModel:
    """duration = fixed + per_row * rows + per_prefill_token * prefill tokens + per_draft_token * drafted tokens
    + per_block * context blocks, fitted by recursive least squares with forgetting, so it follows the device,
    the model, the batch and the machine's load. Before it has seen a draft, a drafted token costs nothing by
    its estimate: the first drafts are tried, and their cost is then learnt."""

    def __init__(self) -> None:
        self._theta = [0.0] * NUM_FEATURES
        self._p = [[PRIOR_VARIANCE if i == j else 0.0 for j in range(NUM_FEATURES)] for i in range(NUM_FEATURES)]
        self.num_observations = 0
        self.num_prefill_steps = 0
        self.decode_only_s: dict[int, float] = {}  # rows -> measured duration of steps of only that many decodes

    @property
    def ready(self) -> bool:
        """Whether the fit has seen enough steps, some of them with prefill chunks, to be used."""
        return self.num_observations >= MIN_OBSERVATIONS and self.num_prefill_steps >= MIN_PREFILL_STEPS

    def estimate(self, shape: StepShape) -> float:
        """The step's estimated duration in seconds (at least 0)."""
        return max(0.0, sum(t * x for t, x in zip(self._theta, shape.features())))

    def estimate_decodes(self, shape: StepShape) -> float:
        """The estimated duration of a step of only decodes: the fit's, or the measured steps of as many
        decodes where less. When nearly every step carries the same rows and a prefill chunk, the fit
        cannot tell the fixed cost from the rows' and the chunk row's, and its extrapolation to no prefill
        was 2-5x the measured decode step on the dev CPU."""
        estimate = self.estimate(shape)
        measured = self.decode_only_s.get(shape.num_rows)
        return estimate if measured is None else min(estimate, measured)

    def _coefficient(self, index: int) -> float:
        return self._theta[index] / FEATURE_SCALES[index]

    @property
    def per_row_s(self) -> float:
        """The estimated cost of one more row, its first token included."""
        return max(MIN_COST_S, self._coefficient(1))

    @property
    def per_prefill_token_s(self) -> float:
        """The estimated cost of one more token in a prefill chunk."""
        return max(MIN_COST_S, self._coefficient(2))

    @property
    def per_draft_token_s(self) -> float:
        """The estimated cost of one more drafted token in a verify row."""
        return max(MIN_COST_S, self._coefficient(3))

    @property
    def per_block_s(self) -> float:
        """The estimated cost of reading one more block of context."""
        return max(0.0, self._coefficient(4))

    def start_step(self, decodes: StepShape) -> None:
        """A step's decodes are placed (before its drafts and prefill): their estimated time is what its rows
        wait for, should the step turn out to carry more than decodes (`observe`)."""
        ready = decodes.num_rows and self.cost.ready
        self._decodes = (decodes.num_rows, self.cost.estimate_decodes(decodes)) if ready else None

    def observe(self, shape: StepShape, duration_s: float) -> None:
        """One step's measured duration."""
        if shape.num_rows == 0:
            return
        if self.ready:
            duration_s = min(duration_s, OUTLIER_MULTIPLE * max(self.estimate(shape), MIN_COST_S))
        if shape.num_rows and not shape.num_prefill_tokens and not shape.num_draft_tokens:
            previous = self.decode_only_s.get(shape.num_rows)
            self.decode_only_s[shape.num_rows] = duration_s if previous is None else (
                DECODE_ONLY_DECAY * previous + (1 - DECODE_ONLY_DECAY) * duration_s)
        x = shape.features()
        p, size = self._p, NUM_FEATURES
        px = [sum(p[i][j] * x[j] for j in range(size)) for i in range(size)]
        forgetting = FORGETTING if sum(p[i][i] for i in range(size)) < MAX_TRACE else 1.0
        gain_denominator = forgetting + sum(x[i] * px[i] for i in range(size))
        gain = [v / gain_denominator for v in px]
        error = duration_s - sum(t * v for t, v in zip(self._theta, x))
        self._theta = [t + g * error for t, g in zip(self._theta, gain)]
        self._p = [[(p[i][j] - gain[i] * px[j]) / forgetting for j in range(size)] for i in range(size)]
        self.num_observations += 1
        self.num_prefill_steps += shape.num_prefill_tokens > 0


class RecentQuantile:
    """A quantile of the last `size` values added, each counted with its weight: the smallest value at or
    below which at least `q` of the weight lies. Sorted when asked after an add (a few hundred values)."""

    def __init__(self, size: int, q: float) -> None:
        self._values: deque[tuple[float, float]] = deque(maxlen=size)
        self.q = q
        self._quantile: float | None = None

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float, weight: float = 1.0) -> None:
        self._values.append((value, weight))
        self._quantile = None

    def value(self) -> float:
        """The quantile (ValueError when empty)."""
        if self._quantile is None:
            ordered = sorted(self._values)
            if not ordered:
                raise ValueError("no values")
            wanted, seen = self.q * sum(weight for _, weight in ordered) * (1 - 1e-12), 0.0
            index = 0
            while index < len(ordered) - 1 and seen + ordered[index][1] < wanted:
                seen += ordered[index][1]
                index += 1
            self._quantile = ordered[index][0]
        return self._quantile


class StepTimeBudget:
    """How many prefill tokens a step may add (module doc): `max_step_s` a fixed limit, or None for
    `DECODE_MULTIPLE` times a stream's usual gap (or the step's own decodes, before the usual gap is
    known). The scheduler starts every step with it (`start_step`), asks it when there are prompt tokens to
    place, and shows it every step's measured time before the cost model learns from it (`observe`)."""

    def __init__(self, cost: StepCostModel, max_step_s: float | None, min_prefill_tokens: int) -> None:
        self.cost = cost
        self.max_step_s = max_step_s
        # Every step may prefill this much, whatever the estimate: a prompt always makes progress.
        self.min_prefill_tokens = min_prefill_tokens
        self.last_limit_s = 0.0  # the limit of the last step that had one (the monitor shows it)
        self._gaps = RecentQuantile(USUAL_GAP_STEPS, 0.5)  # each step's decodes' time, weighted by its rows
        self._overruns = RecentQuantile(MARGIN_STEPS, MARGIN_QUANTILE)  # measured / estimated, steps with prefill
        self._decodes: tuple[int, float] | None = None  # rows and estimated time of the started step's decodes

    def usual_gap_s(self) -> float | None:
        """A stream's usual gap: the median over the rows of the last `USUAL_GAP_STEPS` steps with decodes of
        their decodes' time, measured for a step of only decodes, estimated for one with prefill or drafts
        (each of a step's rows waits for the step, as the inter-token latency counts; a step's prefill
        does not count, or the limit would feed on itself). None before `MIN_USUAL_GAP_STEPS` steps."""
        return self._gaps.value() if len(self._gaps) >= MIN_USUAL_GAP_STEPS else None

    @property
    def margin(self) -> float:
        """The `MARGIN_QUANTILE` of measured over estimated time of the last `MARGIN_STEPS` steps that
        prefilled beside another row (1 before `MIN_MARGIN_STEPS` of them), within [MIN_MARGIN,
        MAX_MARGIN]: a step's estimate is fitted to the limit over it, so that about 19 in 20 such steps
        end within the limit (the fit aims at the mean: half the steps fitted to it would overrun)."""
        if len(self._overruns) < MIN_MARGIN_STEPS:
            return 1.0
        return min(MAX_MARGIN, max(MIN_MARGIN, self._overruns.value()))

    def start_step(self, decodes: StepShape) -> None:
        """A step's decodes are placed (before its drafts and prefill): their estimated time is what its rows
        wait for, should the step turn out to carry more than decodes (`observe`)."""
        ready = decodes.num_rows and self.cost.ready
        self._decodes = (decodes.num_rows, self.cost.estimate_decodes(decodes)) if ready else None

    def observe(self, shape: StepShape, duration_s: float) -> None:
        """The step of `shape` took `duration_s`: its decodes' time joins the usual gaps; a step that
        prefilled beside another row, once the cost is learnt, tells how far the measured time strays from
        the estimate (the estimate the step was scheduled with, near enough: the fit has not learnt from
        it yet)."""
        decodes, self._decodes = self._decodes, None
        if not shape.num_prefill_tokens and not shape.num_draft_tokens:
            if shape.num_rows:
                self._gaps.add(duration_s, shape.num_rows)
        elif decodes is not None:
            self._gaps.add(decodes[1], decodes[0])
        if self.cost.ready and shape.num_prefill_tokens and shape.num_rows >= 2:
            self._overruns.add(duration_s / max(self.cost.estimate(shape), MIN_COST_S))

    def prefill_tokens(self, decodes: StepShape, now: StepShape) -> int | None:
        """Prefill tokens a step whose decodes are `decodes`, and which holds `now` so far (the decodes and
        their drafts), may add; None: only the token budget bounds it (no decodes to keep steady). Before
        the cost is learnt: `UNLEARNT_PREFILL_TOKENS` (or the floor, if higher)."""
        cost = self.cost
        if decodes.num_rows == 0:
            return None
        if not cost.ready:
            return max(self.min_prefill_tokens, UNLEARNT_PREFILL_TOKENS)
        limit = self.max_step_s
        if limit is None:
            usual = self.usual_gap_s()
            limit = DECODE_MULTIPLE * (usual if usual is not None else cost.estimate_decodes(decodes))
        self.last_limit_s = limit
        left = limit / self.margin - cost.estimate(now) - cost.per_row_s
        return max(self.min_prefill_tokens, int(left / cost.per_prefill_token_s))

    def encode_tokens_per_s(self) -> float | None:
        """The prefill tokens one second of image encoding counts as against the tokens `prefill_tokens`
        allows (engine/encode_budget.py), or None before the cost is learnt. The allowance is the limit over
        the margin in tokens, and the margin is how far the forward pass overruns its estimate: an encode,
        estimated on its own, counts as its seconds over the margin, in prefill tokens."""
        cost = self.cost
        if not cost.ready:
            return None
        return 1.0 / (self.margin * cost.per_prefill_token_s)
