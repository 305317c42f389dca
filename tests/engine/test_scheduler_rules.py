"""The scheduler's rules on hand-built states (no model), one fixed example each at least.

Each rule that the property test (test_scheduler_properties.py, through tests/helpers/engine_checks.py's
StepChecker) checks on random workloads has a deterministic example here, so that a broken rule fails
every run, not only the runs whose random workload reaches it; the examples sit at the rule's bound
where it has one (exactly fits / one past):
- budget: `test_a_step_fills_the_token_budget_exactly_decodes_first_then_a_prompt_chunk`; without
  chunked prefill, `test_without_chunked_prefill_a_whole_prompt_runs_alone_past_the_budget_never_beside_another`.
- slots (samples and beams count; a request not forked yet counts its n):
  `test_slots_count_every_sample_and_n_for_a_request_not_forked_yet`,
  `test_a_request_prefilling_for_n_samples_holds_n_slots_before_it_forks`.
- states (one queue matching the state; blocks on the GPU while running, in the CPU pool while
  swapped, none while waiting or finished): `test_a_victim_sits_in_its_modes_queue_holding_what_the_mode_leaves_it`,
  `test_finish_takes_a_request_out_of_its_queue_and_gives_its_blocks_back`.
- block moves (copies only copy-on-write of a sequence in the step, nothing of a victim left in the
  step, nothing swapped in by a step that preempted): `test_a_victim_leaves_no_block_move_in_the_step`,
  `test_nothing_is_admitted_in_a_step_that_preempted_even_a_request_that_would_fit`,
  `test_readmitted_samples_prefill_their_common_prompt_once_and_share_it`.
- progress: `test_a_request_that_fits_the_pool_exactly_is_admitted_when_nothing_runs`,
  `test_a_request_alone_in_a_pool_too_small_for_it_fails_with_a_reason`.
- (re)admission in arrival order: `test_admission_is_first_come_first_served`,
  `test_readmission_follows_arrival_across_the_swapped_and_waiting_queues`,
  `test_a_request_preempted_by_recompute_waits_ahead_of_newer_waiting_requests`.
- victims (only when the appends need more blocks than are available; the newest running request,
  passing over those readmitted and not sampled since; the one needing the blocks yields itself):
  `test_preemption_only_when_the_appends_need_more_blocks_than_are_available`,
  `test_the_newest_request_not_just_readmitted_is_the_victim`, `test_a_victim_leaves_no_block_move_in_the_step`,
  and the protection set on readmission in `test_a_victim_sits_in_its_modes_queue_holding_what_the_mode_leaves_it`.
- work conservation (every running sequence gets its tokens unless the budget ran out: the budget
  examples above; the oldest queued request is admitted as soon as it fits by the admission rule):
  `test_the_oldest_queued_request_comes_in_when_it_fits_exactly_and_waits_one_block_past`.
The property test's end-of-run checks have engine-level fixed examples in test_pressure.py (refused
exactly when a request can never fit, outputs equal to each request run alone, a bound on the steps)
and test_engine.py (`test_requests_that_can_never_fit_are_refused_before_taking_blocks`).

Each test sets the block manager and the queues up as the engine would have left them after a step:
a running request's samples hold their computed tokens, the token each sampled last is pending.
"""

from __future__ import annotations

import pytest

from localserve.engine.scheduler import Scheduler
from localserve.engine.sequence import Request, RequestState
from tests.helpers.scheduler_states import (
    finish_step,
    make_request,
    make_scheduler,
    query_lens,
    row_requests,
    row_seqs,
    run,
    sample,
)


@pytest.mark.parametrize("prefix", [False, True])
def test_readmitted_samples_prefill_their_common_prompt_once_and_share_it(prefix):
    scheduler = make_scheduler(16, prefix=prefix)
    bm = scheduler.block_manager
    prompt = list(range(3, 23))  # 20 tokens: one full block
    request = make_request(0, prompt, [[100 + 13 * i + j for j in range(13)] for i in range(4)])
    request.num_preemptions = 1  # preempted by recompute: waiting, holding nothing
    scheduler.queues.waiting.append(request)
    batch = scheduler.schedule()
    tables = [bm.block_table(seq.seq_id) for seq in request.seqs]
    assert len({table[0] for table in tables}) == 1 and bm.ref_count(tables[0][0]) == 4
    assert bm.num_used_blocks == 3 + 3 * 2  # the leader 3 blocks, each of the others 2 more
    assert [(seq, q) for seq, q in zip(row_seqs(batch), query_lens(batch))] == [(request.seqs[0], 33)]
    finish_step(scheduler, batch)  # the leader has computed the shared block: the others start after it
    batch = scheduler.schedule()
    assert [(seq, q, seq.num_computed_tokens) for seq, q in zip(row_seqs(batch), query_lens(batch))] == \
        [(seq, 17, 16) for seq in request.seqs[1:]]
    finish_step(scheduler, batch)
    assert not request.followers and all(seq.num_uncomputed_tokens == 0 for seq in request.seqs)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_victim_leaves_no_block_move_in_the_step(mode):
    # An older request O whose two samples just forked (the first to append copies their shared partly
    # filled block) and a request R swapped in last step whose last block is full. One block is free.
    scheduler = make_scheduler(5, mode)
    older = run(scheduler, make_request(0, list(range(3, 23)), [[5], [6]]))
    readmitted = run(scheduler, make_request(1, list(range(30, 62)), [[7]]))
    readmitted.just_readmitted = True
    if mode == "recompute":  # and a swapped request that could take the blocks a victim frees
        run(scheduler, make_request(2, list(range(70, 80)), [[8]]), RequestState.SWAPPED)
    bm = scheduler.block_manager
    assert bm.num_available_blocks == 1
    batch = scheduler.schedule()
    step = batch.step_input
    scheduled = {seq.seq_id for seq in row_seqs(batch)}
    for source, destination, _ in step.block_copies:  # a sample running now copies what a sibling keeps
        assert any(seq.seq_id in scheduled and bm.block_table(seq.seq_id)[-1] == destination
                   and any(bm.block_table(sibling.seq_id)[-1] == source for sibling in request.live_seqs)
                   for request in scheduler.queues.running for seq in request.live_seqs), \
            f"copy {source}->{destination} is not the copy-on-write of a sequence that runs in this step"
        assert destination not in {gpu for gpu, _, _ in step.swap_out} | {gpu for _, gpu, _ in step.swap_in}
    # The request that needed the block yields itself rather than evict the older one.
    assert batch.preempted == [readmitted] and older.state is RequestState.RUNNING
    assert not step.swap_in  # nothing comes back in a step that preempted
    bm.check_integrity()


def test_the_newest_request_not_just_readmitted_is_the_victim():
    scheduler = make_scheduler(8)
    oldest = run(scheduler, make_request(0, list(range(3, 35)), [[5]]))  # 32 tokens: needs a block
    middle = run(scheduler, make_request(1, list(range(40, 60)), [[6]]))
    newest = run(scheduler, make_request(2, list(range(70, 90)), [[7]]))
    newest.just_readmitted = True
    filler = run(scheduler, make_request(3, list(range(100, 132)), [[8]]))  # takes the rest of the pool
    filler.just_readmitted = True
    assert scheduler.block_manager.num_available_blocks == 0
    batch = scheduler.schedule()
    # filler and newest are protected; oldest's block comes from middle, the newest unprotected one.
    assert batch.preempted == [middle] and {r.label for r in scheduler.queues.running} == {"r0", "r2", "r3"}
    assert oldest.seqs[0] in row_seqs(batch)


def test_admission_is_first_come_first_served():
    scheduler = make_scheduler(6)
    bm = scheduler.block_manager
    running = run(scheduler, make_request(0, list(range(3, 35)), [[5]], max_tokens=40))  # 32 tokens + 1
    big = make_request(1, list(range(40, 90)), [[]], max_tokens=2)  # 50 tokens: 4 blocks, not now
    small = make_request(2, [7, 8], [[]], max_tokens=2)  # would fit now
    scheduler.queues.waiting += [big, small]
    batch = scheduler.schedule()
    assert {seq.seq_id for seq in row_seqs(batch)} == {running.seqs[0].seq_id}  # small does not pass big
    assert scheduler.queues.waiting == [big, small] and bm.num_available_blocks == 3
    scheduler.finish(running)
    batch = scheduler.schedule()
    assert [r.label for r in row_requests(batch)] == ["r1", "r2"]


def test_a_request_alone_in_a_pool_too_small_for_it_fails_with_a_reason():
    # The engine refuses such a request when it is added (peak_blocks); the scheduler still never loops.
    scheduler = make_scheduler(2)
    request = run(scheduler, make_request(0, list(range(3, 19)), [[5], [6]]))  # 16 tokens each + 1
    batch = scheduler.schedule()
    assert batch.failed == [request] and "too small" in request.error and request.is_finished
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_work()


def test_readmission_follows_arrival_across_the_swapped_and_waiting_queues():
    # r0 fell back to recompute (the swap pool was full of r1, preempted by swap before it). Either
    # fits the 4 blocks, not both (r0: 2 blocks + 1 of growth; r1 beside it: 1 + 1 + 1): r0 comes back first.
    scheduler = make_scheduler(4, "swap")
    fallback = make_request(0, list(range(3, 23)), [[5]])
    fallback.num_preemptions = 1
    scheduler.queues.waiting.append(fallback)
    swapped = run(scheduler, make_request(1, list(range(30, 40)), [[7]]), RequestState.SWAPPED)
    batch = scheduler.schedule()
    assert [r.label for r in row_requests(batch)] == ["r0"] and fallback.state is RequestState.RUNNING
    assert not batch.step_input.swap_in and scheduler.queues.swapped == [swapped]
    finish_step(scheduler, batch)
    scheduler.finish(fallback)
    batch = scheduler.schedule()
    assert batch.step_input.swap_in and swapped.state is RequestState.RUNNING


def prefilling(scheduler: Scheduler, arrival: int, prompt: list[int], n: int, num_computed: int) -> Request:
    """A running request of `n` samples, not forked yet, with `num_computed` of its prompt's tokens computed."""
    request = make_request(arrival, prompt, [[]], n=n)
    seq = request.seqs[0]
    scheduler.block_manager.allocate(seq.seq_id, seq.token_ids, share_token_ids=True)
    scheduler.block_manager.mark_computed(seq.seq_id, num_computed)
    seq.num_computed_tokens = num_computed
    request.state = RequestState.RUNNING
    scheduler.queues.running.append(request)
    return request


def test_a_step_fills_the_token_budget_exactly_decodes_first_then_a_prompt_chunk():
    # Budget 8: the three decodes take 3, the new prompt of 20 gets a chunk of the 5 left, then 5 more.
    scheduler = make_scheduler(16, budget=8)
    decoding = [run(scheduler, make_request(i, [40 + i] * 5, [[5]])) for i in range(3)]
    prompt = make_request(3, list(range(100, 120)), [[]], max_tokens=2)
    scheduler.queues.waiting.append(prompt)
    for step in range(2):
        batch = scheduler.schedule()
        assert query_lens(batch) == [1, 1, 1, 5] and batch.num_tokens == 8
        assert row_seqs(batch)[:3] == [r.seqs[0] for r in decoding] and row_seqs(batch)[3] is prompt.seqs[0]
        assert batch.step_input.chunks[3].start_pos == 5 * step
        sample(scheduler, batch)


def test_without_chunked_prefill_a_whole_prompt_runs_alone_past_the_budget_never_beside_another():
    scheduler = make_scheduler(16, budget=16, chunked=False)
    short = make_request(0, list(range(100, 110)), [[]], max_tokens=4)
    long = make_request(1, list(range(200, 240)), [[]], max_tokens=4)  # 40 tokens, over the budget
    scheduler.queues.waiting += [short, long]
    batch = scheduler.schedule()
    assert query_lens(batch) == [10] and long.state is RequestState.RUNNING  # admitted, its prompt left out
    sample(scheduler, batch)
    batch = scheduler.schedule()
    assert row_seqs(batch) == [short.seqs[0], long.seqs[0]] and query_lens(batch) == [1, 40]  # whole, no other prefill
    sample(scheduler, batch)
    batch = scheduler.schedule()
    assert query_lens(batch) == [1, 1]


@pytest.mark.parametrize("max_num_seqs, admitted", [(4, True), (3, False)])
def test_slots_count_every_sample_and_n_for_a_request_not_forked_yet(max_num_seqs, admitted):
    # Running: r0's 2 forked samples; r1 waits with n=2 (one sequence until it forks): 4 slots in all.
    scheduler = make_scheduler(32, max_num_seqs=max_num_seqs)
    run(scheduler, make_request(0, list(range(3, 23)), [[5], [6]]))
    waiting = make_request(1, list(range(60, 70)), [[]], n=2, max_tokens=4)
    scheduler.queues.waiting.append(waiting)
    batch = scheduler.schedule()
    assert (waiting in row_requests(batch)) == admitted and (waiting.state is RequestState.RUNNING) == admitted


@pytest.mark.parametrize("max_num_seqs, admitted", [(4, True), (3, False)])
def test_a_request_prefilling_for_n_samples_holds_n_slots_before_it_forks(max_num_seqs, admitted):
    scheduler = make_scheduler(32, max_num_seqs=max_num_seqs)
    prefilling(scheduler, 0, list(range(3, 43)), n=3, num_computed=16)
    waiting = make_request(1, list(range(60, 70)), [[]], max_tokens=4)
    scheduler.queues.waiting.append(waiting)
    batch = scheduler.schedule()
    assert query_lens(batch)[0] == 24 and (waiting in row_requests(batch)) == admitted


def older_and_newer(mode: str, num_cpu_blocks: int = 8) -> tuple[Scheduler, Request, Request]:
    """A full 4-block pool: an older request whose pending token needs a new block (its 32 tokens fill
    2), a newer one whose pending token fits its own second block. The next step preempts the newer."""
    scheduler = make_scheduler(4, mode, num_cpu_blocks=num_cpu_blocks)
    older = run(scheduler, make_request(0, list(range(3, 35)), [[5]], max_tokens=40))
    newer = run(scheduler, make_request(1, list(range(40, 60)), [[6]]))
    assert scheduler.block_manager.num_available_blocks == 0
    return scheduler, older, newer


@pytest.mark.parametrize("mode, num_cpu_blocks", [("recompute", 8), ("swap", 8), ("swap", 1)])
def test_a_victim_sits_in_its_modes_queue_holding_what_the_mode_leaves_it(mode, num_cpu_blocks):
    scheduler, older, newer = older_and_newer(mode, num_cpu_blocks)
    bm = scheduler.block_manager
    seq = newer.seqs[0]
    batch = scheduler.schedule()
    assert batch.preempted == [newer] and scheduler.queues.running == [older]
    if mode == "swap" and num_cpu_blocks >= 2:
        assert scheduler.queues.swapped == [newer] and not scheduler.queues.waiting \
            and newer.state is RequestState.SWAPPED
        assert bm.is_swapped(seq.seq_id) and len(batch.step_input.swap_out) == 2
        assert seq.num_computed_tokens == 20 and seq.pending_append  # its KV and its next token kept
    else:  # by recompute, also when the swap pool is too small for its 2 blocks
        assert scheduler.queues.waiting == [newer] and not scheduler.queues.swapped \
            and newer.state is RequestState.WAITING
        with pytest.raises(KeyError):
            bm.is_swapped(seq.seq_id)
        assert seq.num_computed_tokens == 0 and not seq.pending_append and not batch.step_input.swap_out
        assert scheduler.preemption.num_swap_fallbacks == (mode == "swap")
    assert bm.num_used_blocks == 3  # the older request's 2 and the new block its pending token took
    sample(scheduler, batch)
    scheduler.finish(older)
    batch = scheduler.schedule()  # it comes back at once, protected until it samples
    assert newer.state is RequestState.RUNNING and newer.just_readmitted and not bm.is_swapped(seq.seq_id)
    assert bool(batch.step_input.swap_in) == (mode == "swap" and num_cpu_blocks >= 2)


@pytest.mark.parametrize("state", [RequestState.RUNNING, RequestState.SWAPPED, RequestState.WAITING])
def test_finish_takes_a_request_out_of_its_queue_and_gives_its_blocks_back(state):
    scheduler = make_scheduler(8, "swap")
    bm = scheduler.block_manager
    other = run(scheduler, make_request(0, list(range(3, 23)), [[5]]))
    request = make_request(1, list(range(30, 50)), [[6], [7]])
    if state is RequestState.WAITING:
        scheduler.queues.waiting.append(request)
    else:
        run(scheduler, request, state)
    scheduler.finish(request)
    assert request.state is RequestState.FINISHED
    assert (scheduler.queues.running, scheduler.queues.swapped, scheduler.queues.waiting) == ([other], [], [])
    assert bm.num_used_blocks == 2 and bm.num_free_cpu_blocks == 8
    for seq in request.seqs:
        with pytest.raises(KeyError):
            bm.is_swapped(seq.seq_id)
    bm.check_integrity()


def test_a_request_that_fits_the_pool_exactly_is_admitted_when_nothing_runs():
    # 20 + 13 tokens, the 13th never written: 32 tokens, exactly the 2 blocks (peak_blocks == pool).
    scheduler = make_scheduler(2)
    request = make_request(0, list(range(3, 23)), [[]], max_tokens=13)
    assert scheduler.admission.peak_blocks(request) == 2
    scheduler.queues.waiting.append(request)
    batch = scheduler.schedule()
    assert row_requests(batch) == [request] and query_lens(batch) == [20]


def test_a_request_preempted_by_recompute_waits_ahead_of_newer_waiting_requests():
    scheduler, older, newer = older_and_newer("recompute")
    latest = make_request(2, [7, 8, 9], [[]], max_tokens=2)
    scheduler.queues.waiting.append(latest)
    batch = scheduler.schedule()
    assert batch.preempted == [newer] and scheduler.queues.waiting == [newer, latest]
    sample(scheduler, batch)
    scheduler.finish(older)
    batch = scheduler.schedule()
    assert [r.label for r in row_requests(batch)] == ["r1", "r2"]


@pytest.mark.parametrize("num_needing_a_block, preempted", [(1, False), (2, True)])
def test_preemption_only_when_the_appends_need_more_blocks_than_are_available(num_needing_a_block, preempted):
    # One block is available. Two running requests of 32 + 1 tokens (each pending token needs a block)
    # or one of those beside one of 20 + 1 (its pending token fits its own last block).
    scheduler = make_scheduler(5)
    older = run(scheduler, make_request(0, list(range(3, 35)), [[5]]))
    newer_prompt = list(range(40, 72)) if num_needing_a_block == 2 else list(range(40, 60))
    newer = run(scheduler, make_request(1, newer_prompt, [[6]]))
    assert scheduler.block_manager.num_available_blocks == 1
    batch = scheduler.schedule()
    assert batch.preempted == ([newer] if preempted else [])
    assert row_seqs(batch) == [older.seqs[0]] + ([] if preempted else [newer.seqs[0]])


@pytest.mark.parametrize("queue", ["waiting", "swapped"])
@pytest.mark.parametrize("num_blocks, admitted", [(6, True), (5, False)])
def test_the_oldest_queued_request_comes_in_when_it_fits_exactly_and_waits_one_block_past(queue, num_blocks,
                                                                                         admitted):
    # A decoding request holds 2 blocks. The queued one takes 2 now (20 tokens), one block of headroom
    # for the running sequence and one for its own growth (up to 20 + 19 written tokens: 3 blocks):
    # 4 blocks, exactly what a 6-block pool has left.
    scheduler = make_scheduler(num_blocks, "swap")
    running = run(scheduler, make_request(0, list(range(3, 23)), [[5]]))
    if queue == "swapped":
        queued = run(scheduler, make_request(1, list(range(30, 50)), [[7]], max_tokens=20), RequestState.SWAPPED)
    else:
        queued = make_request(1, list(range(30, 50)), [[]], max_tokens=20)
        scheduler.queues.waiting.append(queued)
    assert scheduler.block_manager.num_available_blocks == num_blocks - 2
    batch = scheduler.schedule()
    assert (queued.state is RequestState.RUNNING) == admitted
    assert row_seqs(batch)[0] is running.seqs[0] and not batch.preempted
    if queue == "swapped":
        assert bool(batch.step_input.swap_in) == admitted
    else:
        assert (queued.seqs[0] in row_seqs(batch)) == admitted


def test_nothing_is_admitted_in_a_step_that_preempted_even_a_request_that_would_fit():
    # r0's pending token needs a block and none is free: r2, the newest, is preempted, freeing 3 blocks,
    # r0 takes 1. r1 (preempted by recompute before, 3 tokens) would fit the 2 left, but waits a step.
    scheduler = make_scheduler(5)
    older = run(scheduler, make_request(0, list(range(3, 35)), [[5]]))
    waiting = make_request(1, [7, 8, 9], [[]], max_tokens=2)
    waiting.num_preemptions = 1
    scheduler.queues.waiting.append(waiting)
    newest = run(scheduler, make_request(2, list(range(40, 80)), [[6]]))
    assert scheduler.block_manager.num_available_blocks == 0
    batch = scheduler.schedule()
    assert batch.preempted == [newest] and row_seqs(batch) == [older.seqs[0]]
    assert scheduler.queues.waiting == [waiting, newest] and scheduler.block_manager.num_available_blocks == 2
    sample(scheduler, batch)
    batch = scheduler.schedule()
    assert waiting in row_requests(batch)  # the next step
