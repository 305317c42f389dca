"""The image encoder's time in the step's time budget (engine/encode_budget.py), on the scheduler alone (no
model: a step's cost is a fixed linear law, an image's encode a fixed cost per token). Fixed examples: a new
image beside decoding streams whose text fits the budget but whose encode does not stops the chunk before
it and goes in a later step with room; a cached image goes at once; the step's first prefill chunk takes an
image that does not fit; without chunked prefill a prompt waits whole. Generated workloads: no step's
estimated time (the law, plus the encodes of its new images) passes the limit but by the first-chunk
allowance, every request finishes, the scheduler ends idle with every block back; with images that cost
nothing the plans are those of a scheduler that charges none."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from localserve.engine.config import SchedulerConfig
from localserve.engine.encode_budget import ENCODE_OUTLIER_MULTIPLE, EncoderCost
from localserve.engine.scheduler import Scheduler
from localserve.engine.sequence import Request
from localserve.engine.step_budget import StepCostModel, StepShape, StepTimeBudget
from localserve.kv.block_manager import BlockManager
from tests.helpers.scheduler_states import make_request, query_lens, run, sample
from tests.helpers.step_costs import LinearStepCost

FIXED, PER_ROW, PER_TOKEN = 5e-3, 2e-3, 1e-3  # a step's law: 5 ms, 2 ms a row, 1 ms a prompt token
DECODERS = 4
LIMIT = FIXED + DECODERS * PER_ROW + PER_ROW + 150.5 * PER_TOKEN  # 150 prompt tokens beside 4 decodes
IMAGE = 64  # tokens of an image


def LinearCost() -> LinearStepCost:  # noqa: N802 - the law, as a learnt cost
    return LinearStepCost(FIXED, PER_ROW, PER_TOKEN)


def make(cached: set[bytes], encode_equiv: float | None, chunked: bool = True, limit: float = LIMIT) -> Scheduler:
    """A scheduler with a time budget of `limit`, images cached when in `cached`, an image of IMAGE tokens
    costing `encode_equiv` prompt tokens' time (None: no encode measured yet)."""
    budget = StepTimeBudget(LinearCost(), limit, min_prefill_tokens=1)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, enable_chunked_prefill=chunked),
                          BlockManager(128, 16), step_budget=budget, image_cached=cached.__contains__)
    if encode_equiv is not None:
        scheduler.observe_encode(IMAGE, encode_equiv * PER_TOKEN)
    return scheduler


def image_request(arrival: int, parts: list, bidirectional: bool = True, max_tokens: int = 4) -> Request:
    """Parts: text lengths (ints) and images (bytes: the content hash) of IMAGE tokens, after a <bos>."""
    tokens, spans = [2], []
    for part in parts:
        if isinstance(part, bytes):
            spans.append((len(tokens), len(tokens) + IMAGE, part))
            tokens += [7] * IMAGE
        else:
            tokens += [100 + arrival + i for i in range(part)]
    request = make_request(arrival, tokens, [[]], max_tokens=max_tokens)
    request.image_spans = tuple(spans)
    request.bidirectional_spans = tuple((offset, end) for offset, end, _ in spans) if bidirectional else ()
    return request


def decoders(scheduler: Scheduler, count: int = DECODERS, max_tokens: int = 50) -> None:
    for i in range(count):
        run(scheduler, make_request(100 + i, list(range(10 + i, 30 + i)), [[5, 6, 7]], max_tokens=max_tokens))


def step(scheduler: Scheduler, cached: set[bytes]) -> list[int]:
    """One step as the engine takes it (its images then cached); returns its rows' query lengths."""
    batch = scheduler.schedule()
    for row in batch.rows:
        start, end = row.chunk.start_pos, row.chunk.start_pos + row.query_len
        cached.update(h for offset, span_end, h in row.request.image_spans if offset < end and start < span_end)
    sample(scheduler, batch)
    return query_lens(batch)


def test_a_new_image_whose_encode_does_not_fit_waits_before_its_span_for_a_step_with_room():
    cached: set[bytes] = set()
    scheduler = make(cached, encode_equiv=80)  # the image and its 64 tokens fit 150, not with 20 tokens before
    decoders(scheduler)
    scheduler.add(image_request(0, [20, b"cat", 20]))  # 105 tokens: the text alone fits the step
    assert step(scheduler, cached) == [1] * DECODERS + [21]  # cut before the image: the text goes
    batch = scheduler.schedule()
    # The image's 64 tokens, its encode (80) and as much text as the 150 leave: 6.
    assert query_lens(batch) == [1] * DECODERS + [70]
    assert batch.images.charged == pytest.approx(80) and batch.token_budget == DECODERS + 150 - 80
    sample(scheduler, batch)


@pytest.mark.parametrize("encode_equiv", [None, 0.0, 80.0])
def test_a_cached_image_or_one_that_costs_nothing_yet_goes_at_once(encode_equiv):
    cached = {b"cat"} if encode_equiv == 80.0 else set()
    scheduler = make(cached, encode_equiv)
    decoders(scheduler)
    scheduler.add(image_request(0, [20, b"cat", 20]))
    batch = scheduler.schedule()
    assert query_lens(batch) == [1] * DECODERS + [105]
    assert batch.images.charged == 0


def test_the_steps_first_prefill_chunk_takes_an_image_that_does_not_fit_and_nothing_joins_it():
    cached: set[bytes] = set()
    scheduler = make(cached, encode_equiv=200)  # more than the whole step's 150
    decoders(scheduler)
    scheduler.add(image_request(0, [20, b"cat", 20]))
    assert step(scheduler, cached) == [1] * DECODERS + [21]
    scheduler.add(make_request(1, list(range(40, 60)), [[]]))  # a text prompt arrives
    assert step(scheduler, cached) == [1] * DECODERS + [IMAGE]  # the image alone: nothing is admitted
    assert scheduler.queues.waiting[0].request_id == "req-1"
    assert step(scheduler, cached) == [1] * DECODERS + [20, 20]  # now cached: the rest, and the text prompt


def test_a_later_chunk_waits_for_room_and_goes_when_it_fits():
    cached: set[bytes] = set()
    scheduler = make(cached, encode_equiv=80)
    decoders(scheduler)
    scheduler.add(make_request(0, list(range(40, 80)), [[]], max_tokens=20))  # 40 text tokens first
    scheduler.add(image_request(1, [b"dog", 10]))
    assert step(scheduler, cached) == [1] * DECODERS + [40, 1]  # 65 + 80 do not fit the 110 left: <bos> only
    batch = scheduler.schedule()  # 5 decodes leave 148: the image, its encode and 4 tokens of text
    assert query_lens(batch) == [1] * (DECODERS + 1) + [68] and batch.images.charged == pytest.approx(80)


def test_the_same_new_image_in_two_chunks_of_a_step_is_charged_once():
    cached: set[bytes] = set()
    scheduler = make(cached, encode_equiv=40, limit=LIMIT + 100 * PER_TOKEN)  # 250 beside the decodes
    decoders(scheduler)
    scheduler.add(image_request(0, [b"cat", 5]))
    scheduler.add(image_request(1, [b"cat", 5]))
    batch = scheduler.schedule()  # 70 + 40, then 70 (the same image): 180 of 250
    assert query_lens(batch) == [1] * DECODERS + [70, 70] and batch.images.charged == pytest.approx(40)


def test_without_chunked_prefill_a_prompt_whose_image_does_not_fit_waits_whole_unless_it_is_first():
    cached: set[bytes] = set()
    scheduler = make(cached, encode_equiv=80, chunked=False)
    decoders(scheduler)
    scheduler.add(make_request(0, list(range(40, 80)), [[]], max_tokens=20))
    scheduler.add(image_request(1, [b"dog", 10]))  # 75 tokens: 75 + 80 do not fit the 110 left
    assert step(scheduler, cached) == [1] * DECODERS + [40]
    assert step(scheduler, cached) == [1] * (DECODERS + 1) + [75]  # the step's first prefill: whole, past 148


def test_the_encoder_cost_learns_seconds_per_image_token_and_shrugs_off_a_stall():
    cost = EncoderCost()
    assert cost.seconds_per_token is None and cost.estimate(256) == 0.0
    cost.observe(0, 1.0)  # nothing encoded: nothing learnt
    assert cost.seconds_per_token is None
    cost.observe(256, 0.512)
    assert cost.estimate(100) == pytest.approx(0.2)
    cost.observe(256, 100.0)  # another process held the core: counted as 3x the estimate
    assert cost.num_observations == 2
    assert cost.seconds_per_token == pytest.approx((0.7 * 0.512 + ENCODE_OUTLIER_MULTIPLE * 0.512) / (0.7 * 256 + 256))
    for _ in range(40):  # the machine got slower: the estimate follows
        cost.observe(64, 0.256)
    assert cost.seconds_per_token == pytest.approx(0.004, rel=1e-3)


def test_a_second_of_encoding_counts_as_the_prompt_tokens_it_would_take_over_the_margin():
    assert StepTimeBudget(StepCostModel(), 0.1, 16).encode_tokens_per_s() is None  # the cost is not learnt
    budget = StepTimeBudget(LinearCost(), 0.1, 16)
    assert budget.encode_tokens_per_s() == pytest.approx(1 / PER_TOKEN)
    for _ in range(8):
        budget.observe(StepShape(5, 64, 0, 10), 1.25 * LinearCost().estimate(StepShape(5, 64, 0, 10)))
    assert budget.encode_tokens_per_s() == pytest.approx(1 / (1.25 * PER_TOKEN))


# ---- generated workloads


def workloads():
    text = st.integers(1, 40)
    image = st.integers(0, 3).map(lambda index: b"image%d" % index)  # four pictures: the same one recurs
    # Text last, as chat templates write it: a prompt's last token is computed as a decode row when a chunk
    # ends one short of it (the scheduler charges prefill chunks' images, not decode rows').
    prompt = st.tuples(st.lists(st.one_of(text, image), max_size=3), text).map(lambda parts: [*parts[0], parts[1]])
    request = st.tuples(st.integers(0, 6), prompt, st.booleans(), st.integers(1, 4))  # arrival step, parts, bidi, max
    return st.fixed_dictionaries({
        "decoders": st.integers(0, 3), "requests": st.lists(request, min_size=1, max_size=4),
        "encode_equiv": st.sampled_from([0.0, 10.0, 60.0, 140.0, 400.0]),  # an image's encode, in prompt tokens
        "room": st.integers(20, 200), "capacity": st.integers(0, 3), "chunked": st.booleans(),
        "cached": st.sets(st.integers(0, 3), max_size=2)})


def simulate(work: dict, image_fit: bool = True) -> list[list[int]]:
    """Run the workload step by step (the engine's part: sample, finish at max tokens, keep the images of each
    step's chunks in an LRU cache of `capacity`); check each step's estimated time; returns its plans."""
    cache = [b"image%d" % index for index in sorted(work["cached"])][:work["capacity"]]
    max_rows = work["decoders"] + len(work["requests"])
    limit = FIXED + max_rows * PER_ROW + PER_ROW + work["room"] * PER_TOKEN  # room tokens at the most decodes
    budget = StepTimeBudget(LinearCost(), limit, min_prefill_tokens=1)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512,
                                          enable_chunked_prefill=work["chunked"]),
                          BlockManager(256, 16), step_budget=budget,
                          image_cached=cache.__contains__ if image_fit else None)
    seconds_per_token = work["encode_equiv"] * PER_TOKEN / IMAGE
    scheduler.observe_encode(IMAGE, IMAGE * seconds_per_token)
    decoders(scheduler, work["decoders"], max_tokens=8)
    arrivals = sorted(enumerate(work["requests"]), key=lambda item: item[1][0])
    plans = []
    for number in range(3000):
        while arrivals and arrivals[0][1][0] <= number:
            index, (_, parts, bidirectional, max_tokens) = arrivals.pop(0)
            scheduler.add(image_request(index, parts, bidirectional, max_tokens))
        if not scheduler.has_work() and not arrivals:
            break
        batch = scheduler.schedule()
        plans.append(query_lens(batch))
        check_step(batch, cache, seconds_per_token, limit, work["chunked"])
        encoded = 0
        for row in batch.rows:
            start, end = row.chunk.start_pos, row.chunk.start_pos + row.query_len
            for offset, span_end, content_hash in row.request.image_spans:
                if offset < end and start < span_end:
                    if content_hash in cache:
                        cache.remove(content_hash)
                    else:
                        encoded += span_end - offset
                    cache.append(content_hash)
                    del cache[:max(0, len(cache) - work["capacity"])]
        scheduler.observe_encode(encoded, encoded * seconds_per_token)
        sample(scheduler, batch)
        for request in list(scheduler.queues.running):
            seq = request.seqs[0]
            if seq.num_tokens - seq.prompt_len >= request.params.max_tokens:
                scheduler.finish(request)
                seq.finish_reason = "length"
    else:
        raise AssertionError("the workload did not finish in 3000 steps")
    bm = scheduler.block_manager
    bm.check_integrity()
    assert not scheduler.has_work() and bm.num_used_blocks == 0
    return plans


def check_step(batch, cache: list[bytes], seconds_per_token: float, limit: float, chunked: bool) -> None:
    """The step's estimated time (the law, and the encodes of the images new to it; a row for its prefill chunks
    as the budget counts them) is within the limit, but
    where its first prefill chunk took an image that did not fit (it starts at or inside the image; or a
    bidirectional one, which goes whole as before), or, without chunked prefill, is a whole prompt (which
    passes the budget alone as before): then it is the step's only prefill chunk."""
    seen: set[bytes] = set()
    encode_s = 0.0
    prefills = [row for row in batch.rows if row is not row.seq.decode_row]  # Batch.add's rows
    forced = bool(prefills) and not chunked
    for number, row in enumerate(prefills):
        start, end = row.chunk.start_pos, row.chunk.start_pos + row.query_len
        for offset, span_end, content_hash in row.request.image_spans:
            new = content_hash not in cache and content_hash not in seen
            if offset < end and start < span_end:
                forced |= number == 0 and offset <= start and (new or (offset, span_end) in
                                                               row.request.bidirectional_spans)
                if new:
                    seen.add(content_hash)
                    encode_s += (span_end - offset) * seconds_per_token
    # The budget counts one prefill row's cost (StepTimeBudget.prefill_tokens): a further chunk's row is its own.
    estimate = LinearCost().estimate(batch.shape(16)) + encode_s - max(0, len(prefills) - 1) * PER_ROW
    decodes = len(batch.rows) - len(prefills)
    if decodes and estimate > limit * (1 + 1e-9):
        assert forced and len(prefills) == 1, f"a step of {estimate:.4f} s over the limit of {limit:.4f} s"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
@example({"decoders": 2, "requests": [(0, [20, b"image0", 20], True, 2)], "encode_equiv": 400.0, "room": 100,
          "capacity": 1, "cached": set(), "chunked": True})
@example({"decoders": 1, "requests": [(0, [1], False, 1), (1, [b"image0", 1], False, 1), (0, [b"image0", 1], False, 1)],
          "encode_equiv": 60.0, "room": 20, "capacity": 0, "chunked": True, "cached": set()})
@example({"decoders": 1, "requests": [(0, [5, b"image0", 3, b"image1", 1], False, 2), (1, [b"image0", 8], True, 3)],
          "encode_equiv": 60.0, "room": 90, "capacity": 0, "cached": {0}, "chunked": True})
@example({"decoders": 1, "requests": [(0, [1], False, 1), (0, [1], False, 1), (0, [35], False, 1)],
          "encode_equiv": 0.0, "room": 34, "capacity": 0, "chunked": False, "cached": set()})
@example({"decoders": 3, "requests": [(0, [30], True, 2), (0, [b"image2", 4], True, 1)], "encode_equiv": 140.0,
          "room": 120, "capacity": 2, "cached": set(), "chunked": False})
def test_no_step_passes_the_time_budget_but_by_the_first_chunk_allowance_and_every_request_finishes(work):
    simulate(work)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_images_that_cost_nothing_leave_the_plans_of_a_scheduler_that_charges_none(work):
    work = dict(work, encode_equiv=0.0)
    assert simulate(work) == simulate(work, image_fit=False)
