"""Block manager benchmark: KV slot utilization, blocks saved by sharing, per-step cost against pool size.

    python scripts/bench_block_manager.py [--seed 0]

Prints markdown tables (docs/BENCHMARKS.md, "Block manager"). Takes well under 2 minutes on 2 cores.

1. A seeded trace of requests with mixed prompt and output lengths runs through a continuous-batching
   loop (whole-prompt prefill, then one token per step; at most 32 requests running). Slot utilization
   is the time average, over steps, of tokens held / (blocks used * block_size).
2. The same trace with n=4 parallel samples, and with beam search of width 4 (each step every beam
   picks a parent, keeping its own with probability 3/4: beams picked twice are forked, beams not
   picked are dropped). Blocks used with sharing are compared with what the same sequences would hold
   with no sharing (each its own ceil(tokens / block_size) blocks), on the same steps.
3. The block manager's work in one decode step of 256 running sequences (mark_computed and
   append_token for each, one can_append for all), for pools of 4K, 32K and 256K blocks whose free
   queues start full of cached blocks, so new blocks evict cached ones. 4 rounds of 128 steps, each
   round with 256 fresh sequences (prompts of 16..112 tokens), which it frees at the end.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from localserve.kv.block_manager import BlockManager

BLOCK_SIZE = 16
MAX_RUNNING_REQUESTS = 32
VOCAB_SIZE = 32000


@dataclass
class Request:
    prompt: list[int]
    num_output_tokens: int


@dataclass
class RunningRequest:
    seq_ids: list[int]
    num_output_tokens_left: int
    final_num_tokens: int


def make_trace(num_requests: int, rng: random.Random) -> list[Request]:
    """Chat turns, longer questions and pasted documents, with short to long answers."""
    trace = []
    for _ in range(num_requests):
        prompt_range, output_range = rng.choices([((8, 256), (8, 128)), ((256, 1024), (64, 512)),
                                                  ((1024, 4096), (128, 1024))], weights=[5, 3, 2])[0]
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*prompt_range))]
        trace.append(Request(prompt, rng.randint(*output_range)))
    return trace


def run_trace(trace: list[Request], num_seqs_per_request: int, beam_search: bool,
              rng: random.Random) -> dict[str, float]:
    """Run the trace; returns time-averaged utilization and blocks used with and without sharing."""
    total_tokens = sum(len(r.prompt) + r.num_output_tokens for r in trace) * num_seqs_per_request
    manager = BlockManager(num_blocks=total_tokens // BLOCK_SIZE + len(trace) * num_seqs_per_request)
    waiting = list(reversed(trace))
    running: list[RunningRequest] = []
    next_seq_id = 0
    utilizations, reserved_utilizations, shared_blocks, unshared_blocks = [], [], [], []
    while waiting or running:
        while waiting and len(running) < MAX_RUNNING_REQUESTS:
            request = waiting.pop()
            manager.allocate(next_seq_id, request.prompt)
            manager.mark_computed(next_seq_id, len(request.prompt))  # the prefill step
            seq_ids = [next_seq_id]
            for child in range(next_seq_id + 1, next_seq_id + num_seqs_per_request):
                manager.fork(next_seq_id, child)
                seq_ids.append(child)
            next_seq_id += num_seqs_per_request
            running.append(RunningRequest(seq_ids, request.num_output_tokens,
                                          len(request.prompt) + request.num_output_tokens))
        for request in running:
            for seq_id in request.seq_ids:
                manager.mark_computed(seq_id, manager.num_tokens(seq_id))
            if beam_search:
                request.seq_ids, next_seq_id = reorder_beams(manager, request.seq_ids, next_seq_id, rng)
            for seq_id in request.seq_ids:
                manager.append_token(seq_id, rng.randrange(VOCAB_SIZE))
            request.num_output_tokens_left -= 1
        num_tokens = [manager.num_tokens(seq_id) for request in running for seq_id in request.seq_ids]
        utilizations.append(sum(num_tokens) / (manager.num_used_blocks * BLOCK_SIZE))
        reserved_blocks = sum(-(-r.final_num_tokens // BLOCK_SIZE) * len(r.seq_ids) for r in running)
        reserved_utilizations.append(sum(num_tokens) / (reserved_blocks * BLOCK_SIZE))
        shared_blocks.append(manager.num_used_blocks)
        unshared_blocks.append(sum(-(-n // BLOCK_SIZE) for n in num_tokens))
        for request in [r for r in running if r.num_output_tokens_left == 0]:
            for seq_id in request.seq_ids:
                manager.free(seq_id)
            running.remove(request)
    manager.check_integrity()
    return {"steps": len(utilizations), "utilization": statistics.fmean(utilizations),
            "reserved_utilization": statistics.fmean(reserved_utilizations),
            "shared": statistics.fmean(shared_blocks), "unshared": statistics.fmean(unshared_blocks),
            "peak_shared": max(shared_blocks), "peak_unshared": max(unshared_blocks),
            "cow_copies": manager.cow_copies}


def reorder_beams(manager: BlockManager, beams: list[int], next_seq_id: int,
                  rng: random.Random) -> tuple[list[int], int]:
    parents = [beam if rng.random() < 0.75 else rng.choice(beams) for beam in beams]
    new_beams = []
    for index, parent in enumerate(parents):
        if parent in parents[:index]:
            manager.fork(parent, next_seq_id)
            new_beams.append(next_seq_id)
            next_seq_id += 1
        else:
            new_beams.append(parent)
    for beam in beams:
        if beam not in parents:
            manager.free(beam)
    return new_beams, next_seq_id


def time_decode_steps(num_blocks: int, num_seqs: int, num_rounds: int, num_steps: int,
                      rng: random.Random) -> dict[str, float]:
    """Block-manager time of one decode step over `num_seqs` sequences, over rounds of fresh sequences."""
    manager = BlockManager(num_blocks=num_blocks)
    prompt_len = 1024
    for seq_id in range(num_blocks * BLOCK_SIZE // prompt_len):  # fill the free queue with cached blocks
        manager.allocate(seq_id, [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)])
        manager.mark_computed(seq_id, prompt_len)
        manager.free(seq_id)
    evictions = manager.cached_block_evictions
    step_times = []
    for _ in range(num_rounds):
        seq_ids = list(range(num_seqs))
        for seq_id in seq_ids:
            prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(16, 112))]
            manager.allocate(seq_id, prompt)
            manager.mark_computed(seq_id, len(prompt))
        token_ids = [rng.randrange(VOCAB_SIZE) for _ in range(num_seqs)]
        for _ in range(num_steps):
            start = time.perf_counter()
            for seq_id in seq_ids:  # after the forward pass
                manager.mark_computed(seq_id, manager.num_tokens(seq_id))
            if not manager.can_append(seq_ids):
                raise RuntimeError("pool too small for the benchmark")
            for seq_id, token_id in zip(seq_ids, token_ids, strict=True):
                manager.append_token(seq_id, token_id)
            step_times.append(time.perf_counter() - start)
        manager.check_integrity()
        for seq_id in seq_ids:
            manager.free(seq_id)
    return {"median": statistics.median(step_times), "mean": statistics.fmean(step_times),
            "evictions": manager.cached_block_evictions - evictions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    trace = make_trace(200, rng)
    prompt_lens = sorted(len(r.prompt) for r in trace)
    output_lens = sorted(r.num_output_tokens for r in trace)
    print(f"Trace: {len(trace)} requests (seed {args.seed}), prompt tokens median {prompt_lens[100]} "
          f"(8..4096), output tokens median {output_lens[100]} (8..1024); block size {BLOCK_SIZE}, "
          f"{MAX_RUNNING_REQUESTS} requests running at most.\n")

    single = run_trace(trace, 1, False, rng)
    print("| allocation | KV slots holding real tokens (time average) |")
    print("|---|---|")
    print(f"| lazy, paged (this block manager) | {single['utilization']:.1%} |")
    print(f"| whole final length reserved at admission (for comparison; needs the output length "
          f"known in advance) | {single['reserved_utilization']:.1%} |\n")

    print("| sharing | sequences per request | steps | blocks used, sharing (mean / peak) "
          "| no sharing (mean / peak) | blocks saved (mean) | copy-on-write copies |")
    print("|---|---|---|---|---|---|---|")
    for label, num_seqs, beam_search in (("parallel sampling", 4, False), ("beam search", 4, True)):
        result = run_trace(trace, num_seqs, beam_search, rng)
        print(f"| {label} | {num_seqs} | {result['steps']} "
              f"| {result['shared']:.0f} / {result['peak_shared']} "
              f"| {result['unshared']:.0f} / {result['peak_unshared']} "
              f"| {1 - result['shared'] / result['unshared']:.1%} | {result['cow_copies']} |")

    num_seqs, num_rounds, num_steps = 256, 4, 128
    print(f"\n| pool (blocks) | block manager per decode step, {num_seqs} sequences (median / mean) "
          "| per sequence per step (median) | cached blocks evicted (whole run) |")
    print("|---|---|---|---|")
    for num_blocks in (4096, 32768, 262144):
        timing = time_decode_steps(num_blocks, num_seqs, num_rounds, num_steps, rng)
        print(f"| {num_blocks // 1024}K | {timing['median'] * 1e3:.2f} ms / {timing['mean'] * 1e3:.2f} ms "
              f"| {timing['median'] / num_seqs * 1e6:.2f} µs | {timing['evictions']} |")
    print("\nFor scale: nano-vllm's scheduler and block manager together, ~3.5 µs per sequence per step.")


if __name__ == "__main__":
    main()
