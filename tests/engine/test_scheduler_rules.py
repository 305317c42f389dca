"""The scheduler's rules on hand-built states (no model): readmission shares the common prefix, a
victim leaves no block move behind, the victim rule, FIFO admission, the lone-request failure.

Each test sets the block manager and the queues up as the engine would have left them after a step:
a running request's samples hold their computed tokens, the token each sampled last is pending.
"""

from __future__ import annotations

import itertools

import pytest

from localserve.engine.config import SchedulerConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.sequence import Request, RequestState, Sequence
from localserve.kv.block_manager import BlockManager

_seq_ids = itertools.count()


def make_scheduler(num_blocks: int, mode: str = "recompute", prefix: bool = False, num_cpu_blocks: int = 8,
                   max_num_seqs: int = 8) -> Scheduler:
    bm = BlockManager(num_blocks, 16, num_cpu_blocks, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, preemption_mode=mode), bm)


def make_request(arrival: int, prompt: list[int], outputs: list[list[int]], max_tokens: int = 20,
                 beam: bool = False) -> Request:
    """A request whose len(outputs) samples have generated `outputs` (no blocks yet)."""
    seqs = [Sequence(next(_seq_ids), len(prompt), prompt + output, generator=None) for output in outputs]
    params = SamplingParams(n=len(outputs), max_tokens=max_tokens, beam_search=beam)
    return Request(f"req-{arrival}", arrival, list(prompt), params, seqs, forked=bool(outputs[0]))


def run(scheduler: Scheduler, request: Request, state: RequestState = RequestState.RUNNING) -> Request:
    """Give a request's samples blocks as a step would have left them: prompt shared, tails own, the last
    sampled token of each pending (or, in state SWAPPED, the same moved to the CPU pool)."""
    bm = scheduler.block_manager
    first = request.seqs[0]
    bm.allocate(first.seq_id, request.prompt_token_ids)
    bm.mark_computed(first.seq_id, first.prompt_len)
    for seq in request.seqs[1:]:
        bm.fork(first.seq_id, seq.seq_id)
    for seq in request.seqs:
        for position in range(seq.prompt_len, seq.num_tokens - 1):
            bm.append_token(seq.seq_id, seq.token_ids[position])
            bm.mark_computed(seq.seq_id, position + 1)
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.pending_append = True
    request.state = state
    if state is RequestState.SWAPPED:
        bm.swap_out([seq.seq_id for seq in request.seqs])
        scheduler.swapped.append(request)
    else:
        scheduler.running.append(request)
    return request


def finish_step(scheduler: Scheduler, batch) -> None:
    """What the engine does after the forward pass, short of sampling."""
    scheduler.mark_computed(batch)
    scheduler.block_manager.check_integrity()


@pytest.mark.parametrize("prefix", [False, True])
def test_readmitted_samples_prefill_their_common_prompt_once_and_share_it(prefix):
    scheduler = make_scheduler(16, prefix=prefix)
    bm = scheduler.block_manager
    prompt = list(range(3, 23))  # 20 tokens: one full block
    request = make_request(0, prompt, [[100 + 13 * i + j for j in range(13)] for i in range(4)])
    request.num_preemptions = 1  # preempted by recompute: waiting, holding nothing
    scheduler.waiting.append(request)
    batch = scheduler.schedule()
    tables = [bm.block_table(seq.seq_id) for seq in request.seqs]
    assert len({table[0] for table in tables}) == 1 and bm.ref_count(tables[0][0]) == 4
    assert bm.num_used_blocks == 3 + 3 * 2  # the leader 3 blocks, each of the others 2 more
    assert [(seq, q) for seq, q in zip(batch.seqs, batch.query_lens)] == [(request.seqs[0], 33)]
    finish_step(scheduler, batch)  # the leader has computed the shared block: the others start after it
    batch = scheduler.schedule()
    assert [(seq, q, seq.num_computed_tokens) for seq, q in zip(batch.seqs, batch.query_lens)] == \
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
    scheduled = {seq.seq_id for seq in batch.seqs}
    for source, destination in step.block_copies:  # a sample running now copies what a sibling keeps
        assert any(seq.seq_id in scheduled and bm.block_table(seq.seq_id)[-1] == destination
                   and any(bm.block_table(sibling.seq_id)[-1] == source for sibling in request.live_seqs)
                   for request in scheduler.running for seq in request.live_seqs), \
            f"copy {source}->{destination} is not the copy-on-write of a sequence that runs in this step"
        assert destination not in {gpu for gpu, _ in step.swap_out} | {gpu for _, gpu in step.swap_in}
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
    assert batch.preempted == [middle] and {r.label for r in scheduler.running} == {"r0", "r2", "r3"}
    assert oldest.seqs[0] in batch.seqs


def test_admission_is_first_come_first_served():
    scheduler = make_scheduler(6)
    bm = scheduler.block_manager
    running = run(scheduler, make_request(0, list(range(3, 35)), [[5]], max_tokens=40))  # 32 tokens + 1
    big = make_request(1, list(range(40, 90)), [[]], max_tokens=2)  # 50 tokens: 4 blocks, not now
    small = make_request(2, [7, 8], [[]], max_tokens=2)  # would fit now
    scheduler.waiting += [big, small]
    batch = scheduler.schedule()
    assert {seq.seq_id for seq in batch.seqs} == {running.seqs[0].seq_id}  # small does not pass big
    assert scheduler.waiting == [big, small] and bm.num_available_blocks == 3
    scheduler.finish(running)
    batch = scheduler.schedule()
    assert [r.label for r in batch.requests] == ["r1", "r2"]


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
    scheduler.waiting.append(fallback)
    swapped = run(scheduler, make_request(1, list(range(30, 40)), [[7]]), RequestState.SWAPPED)
    batch = scheduler.schedule()
    assert [r.label for r in batch.requests] == ["r0"] and fallback.state is RequestState.RUNNING
    assert not batch.step_input.swap_in and scheduler.swapped == [swapped]
    finish_step(scheduler, batch)
    scheduler.finish(fallback)
    batch = scheduler.schedule()
    assert batch.step_input.swap_in and swapped.state is RequestState.RUNNING
