"""Hand-built scheduler states for the scheduler's tests (no model): requests, their blocks as a step
would have left them, and the engine's part of a step short of the model (mark computed, sample)."""

from __future__ import annotations

import itertools

from localserve.engine.batch import Batch
from localserve.engine.config import SchedulerConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.sequence import Request, RequestState, Sequence
from localserve.kv.block_manager import BlockManager

_seq_ids = itertools.count()


def make_scheduler(num_blocks: int, mode: str = "recompute", prefix: bool = False, num_cpu_blocks: int = 8,
                   max_num_seqs: int = 8, budget: int = 256, chunked: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, 16, num_cpu_blocks, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     enable_chunked_prefill=chunked, preemption_mode=mode), bm)


def make_request(arrival: int, prompt: list[int], outputs: list[list[int]], max_tokens: int = 20,
                 beam: bool = False, n: int | None = None) -> Request:
    """A request whose len(outputs) samples have generated `outputs` (no blocks yet); a new request of `n`
    samples, not forked yet, has the one sequence `outputs=[[]]`."""
    seqs = [Sequence(next(_seq_ids), len(prompt), prompt + output, generator=None) for output in outputs]
    params = SamplingParams(n=n or len(outputs), max_tokens=max_tokens, beam_search=beam)
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
        scheduler.queues.swapped.append(request)
    else:
        scheduler.queues.running.append(request)
    return request


def finish_step(scheduler: Scheduler, batch: Batch) -> None:
    """What the engine does after the forward pass, short of sampling."""
    scheduler.mark_computed(batch)
    scheduler.block_manager.check_integrity()


def sample(scheduler: Scheduler, batch: Batch) -> None:
    """The rest of what the engine does after the forward pass: each sequence of the step whose whole
    context now has its KV samples a token, pending until the next step writes its KV."""
    finish_step(scheduler, batch)
    for row in batch.rows:
        if row.seq.num_uncomputed_tokens == 0:
            row.seq.token_ids.append(9)
            row.seq.pending_append = True
            row.request.just_readmitted = False


def row_seqs(batch: Batch) -> list[Sequence]:
    """The sequence of each row of the step, in row order."""
    return [row.seq for row in batch.rows]


def row_requests(batch: Batch) -> list[Request]:
    """The request of each row of the step, in row order."""
    return [row.request for row in batch.rows]


def query_lens(batch: Batch) -> list[int]:
    """The query tokens of each row of the step, in row order."""
    return [row.query_len for row in batch.rows]
