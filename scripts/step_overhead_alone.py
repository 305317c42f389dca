"""The scheduler and block manager alone on bench_step_overhead's workload: localserve's, and the installed
nano-vllm-fork's side by side, each driven by the least an engine does around them (random tokens for the
model, append, stop at max_tokens, replace a finished request). Timed per pure decode step, in the same
tight loop for both, so both keep their data in the caches the same way."""

from __future__ import annotations

import importlib
import importlib.util
import random
import statistics
import sys
import time
import types
from collections.abc import Callable
from types import SimpleNamespace

from localserve.engine.config import SchedulerConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.sequence import Request, Sequence
from localserve.kv.block_manager import BlockManager

BLOCK_SIZE = 16
WARMUP = 30
NewRequest = Callable[[random.Random, bool], tuple[list[int], SamplingParams]]


def summarize(times: list[float], sizes: list[int]) -> dict:
    if not times:
        return {"decode_steps": 0}
    seqs = statistics.median(sizes)
    core = statistics.median(times)
    # The mean counts each finished request's cost (its free) whatever N: the median of a step at small N
    # leaves it out (most steps finish nothing), at large N takes it in (most steps finish one or more).
    return {"decode_steps": len(times), "seqs": seqs, "core_us": core * 1e6, "core_us_per_seq": core * 1e6 / seqs,
            "mean_us_per_seq": sum(times) * 1e6 / sum(sizes)}


def run_localserve(new_request: NewRequest, num_seqs: int, num_blocks: int, steps: int, seed: int,
                   vocab: int) -> dict:
    """Scheduler.schedule + mark_computed, then what the engine does to the block manager and the queues
    after sampling (append the token, finish at max_tokens, free), all timed."""
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs + 16384), bm)
    rng = random.Random(seed)
    arrivals = iter(range(10**9))

    def add(residual: bool = False) -> None:
        prompt, params = new_request(rng, residual)
        arrival = next(arrivals)
        scheduler.add(Request(f"req-{arrival}", arrival, prompt, params, [Sequence(arrival, len(prompt), prompt,
                                                                                   None)]))

    for _ in range(num_seqs):
        add(residual=True)
    times, sizes = [], []
    for index in range(WARMUP + steps):
        start = time.thread_time()
        batch = scheduler.schedule()
        scheduler.mark_computed(batch)
        middle = time.thread_time()
        sampled = [(row.seq, row.request) for row in batch.rows if row.chunk.needs_logits]
        token_ids = [rng.randrange(vocab) for _ in sampled]
        resumed = time.thread_time()
        finished = []
        for (seq, request), token_id in zip(sampled, token_ids):
            seq.token_ids.append(token_id)
            seq.pending_append = True
            if not request.forked:  # at its first sampled token, as the engine marks it (n = 1: no copies)
                request.forked = True
            if len(seq.token_ids) >= request.max_num_tokens:  # max_tokens, as the engine checks it
                seq.finish_reason = "length"
                seq.pending_append = False
                bm.free(seq.seq_id)
                scheduler.finish(request)
                finished.append(request)
        end = time.thread_time()
        if index >= WARMUP and batch.num_prefill_tokens == 0 and not batch.preempted:
            times.append(middle - start + end - resumed)
            sizes.append(len(batch.rows))
        for _ in finished:
            add()
    return summarize(times, sizes)


def load_nano_vllm() -> tuple | None:
    """The installed nano-vllm-fork's Scheduler, Sequence and SamplingParams, or None when it is not installed.

    Its package __init__ imports its model runner (flash-attn, CUDA): the package is set up empty and only
    its scheduler, block manager and sequence modules are imported. Nothing of it is copied here.
    """
    spec = importlib.util.find_spec("nanovllm")
    if spec is None or spec.submodule_search_locations is None:
        return None
    package = types.ModuleType("nanovllm")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("nanovllm", package)
    scheduler = importlib.import_module("nanovllm.engine.scheduler")
    sequence = importlib.import_module("nanovllm.engine.sequence")
    sampling = importlib.import_module("nanovllm.sampling_params")
    sequence.Sequence.block_size = BLOCK_SIZE
    return scheduler.Scheduler, sequence.Sequence, sampling.SamplingParams


def run_nano_vllm(nano: tuple, new_request: NewRequest, num_seqs: int, num_blocks: int, steps: int, seed: int,
                  vocab: int) -> dict:
    """nano-vllm-fork's schedule + postprocess (append, finish, free) on the same workload; its steps are
    prefill-only or decode-only."""
    scheduler_class, sequence_class, params_class = nano
    scheduler = scheduler_class(SimpleNamespace(max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs + 16384,
                                                eos=-1, kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=num_blocks))
    rng = random.Random(seed)

    def add(residual: bool = False) -> None:
        prompt, params = new_request(rng, residual)
        scheduler.add(sequence_class(prompt, params_class(max_tokens=params.max_tokens, ignore_eos=True)))

    for _ in range(num_seqs):
        add(residual=True)
    times, sizes = [], []
    for index in range(WARMUP + steps):
        start = time.thread_time()
        seqs, is_prefill = scheduler.schedule()
        middle = time.thread_time()
        token_ids = [rng.randrange(vocab) for _ in seqs]
        resumed = time.thread_time()
        scheduler.postprocess(seqs, token_ids)
        end = time.thread_time()
        if index >= WARMUP and not is_prefill:
            times.append(middle - start + end - resumed)
            sizes.append(len(seqs))
        for seq in seqs:
            if seq.is_finished:
                add()
    return summarize(times, sizes)
