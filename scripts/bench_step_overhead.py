"""Engine step overhead (issue 16): the CPU time of a decode step around the model, per sequence.

The workload: N requests in flight at all times (a finished request is replaced at once by a new one),
prompts of 100-1000 random tokens, 100-1000 output tokens (ignore_eos), greedy, 16-token blocks,
prefix caching on, chunked prefill with a budget of N + 16384 tokens, a fixed seed. The model is a
stand-in that returns random logits (copied from a few random tables into one reused buffer), so only
the engine's own work is left: scheduling, the block manager, building the step's tensors, sampling,
stop rules and outputs. Each N runs with a pool that never preempts, then with one of 0.6x the blocks
that run peaked at (preemption by recompute).

Per pure decode step (no prefill, no preemption in the step), medians of CPU time (time.thread_time:
on a shared machine the wall clock also counts the time other processes held the core), each
configuration run --repeats times:
- scheduler + block manager alone (scripts/step_overhead_alone.py), beside nano-vllm-fork's when that
  package is installed; and the same entry points (Scheduler.schedule / mark_computed / finish,
  BlockManager.free) timed inside the engine's steps;
- the whole engine step outside the model (the stand-in's time and the attention backend's per-step
  metadata, the attention kernels' own input, subtracted), with a one-token and with
  SmolLM2's 49,152-token vocabulary; their difference is the vocabulary-sized work, set against one
  argmax over a [N, 49152] float32 tensor;
- full garbage collections (gc.callbacks) during the measured steps; and, at --profile N, the stages
  (each timed once a step: a timer per request or sequence would cost more than what it measures) and
  a longer run whose windows of 250 steps show the step outside the model as contexts reach their
  steady state.
The last line: `scheduler+block manager: X.XX us/seq/step at N=256` (alone).

    python scripts/bench_step_overhead.py [--sizes 1 64 256 512] [--steps 300] [--vocab-steps 60] [--steady-steps 2000]

`--json-line` measures only the scheduler + block manager alone and the step (vocabulary 1, roomy pool) once
per N and prints them as one JSON line: run it in turns against two versions of the engine (one put
first on PYTHONPATH) to compare them (docs/BENCHMARKS.md, "old against new").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections import defaultdict

import step_overhead_alone
import torch
from benchlib import machine, markdown_table, print_machine, save_raw
from localserve.models.config import ModelConfig
from localserve.models.llama import LlamaForCausalLM

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.engine import LLMEngine
from localserve.engine.sampling_params import SamplingParams
from localserve.llm import settle_garbage_collector

VOCAB = 49_152  # SmolLM2's
BLOCK_SIZE = 16
# The engine's entry points into the scheduler and the block manager (nested calls are counted once).
SCHEDULER_CALLS = ("schedule", "mark_computed", "finish")
BLOCK_MANAGER_CALLS = ("free",)
# Coarse stages of the step outside the model for the profile table: (label, object path, method).
STAGES = (("schedule", "scheduler", "schedule"), ("mark computed", "scheduler", "mark_computed"),
          ("runner: step tensors", "runner", "prepare_inputs"), ("sampler", "", "sampler"),
          ("outputs", "", "_report"))


class Clock:
    """Accumulates the time of wrapped calls; a call made inside another wrapped call is not counted again."""

    def __init__(self) -> None:
        self.total = 0.0
        self.depth = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.thread_time() - start
                self.depth -= 1
        return timed


class RandomTokenModel:
    """Stands in for the model: no forward pass, logits [rows, vocab] copied from a few random tables.

    The logits land in one buffer reused every step, as CUDA's caching allocator hands the model's output
    the same memory again: a fresh 50 MB CPU tensor per step would add a page-faulting allocation and an
    munmap that belong to the model's output, not to the engine.
    """

    can_generate = True  # it has an output head (the engine refuses requests for a model without one)

    def __init__(self, vocab: int, max_rows: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tables = [torch.rand(max_rows, vocab, generator=generator) for _ in range(3)]
        self.logits = torch.empty(max_rows, vocab)
        self.calls = 0
        self.clock = Clock()
        self.forward = self.clock.wrap(self.forward)
        self.compute_logits = self.clock.wrap(self.compute_logits)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        return self.forward(input_ids, positions, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        return torch.zeros(len(input_ids), 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        rows = hidden.shape[0]
        return self.logits[:rows].copy_(self.tables[self.calls % len(self.tables)][:rows])


def new_request(rng: random.Random, residual: bool = False) -> tuple[list[int], SamplingParams]:
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(100, 1000))]
    max_tokens = rng.randint(100, 1000)
    if residual:  # the first N start part-way through their lives, so finishes are spread from the start
        max_tokens = rng.randint(1, max_tokens)
    return prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def stand_in_engine(num_seqs: int, num_blocks: int, vocab: int) -> tuple[LLMEngine, RandomTokenModel]:
    config = ModelConfig("LlamaForCausalLM", vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=8, max_position_embeddings=4096)
    engine = build_engine(LlamaForCausalLM(config), None, EngineConfig(
        num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=num_seqs,
        max_num_batched_tokens=num_seqs + 16384, attention_backend="torch"))
    stand_in = RandomTokenModel(vocab, num_seqs, seed=num_seqs)
    engine.runner.model = stand_in
    # The attention backend's per-step metadata is the attention kernels' input: counted with the model.
    engine.runner.backend.build_metadata = stand_in.clock.wrap(engine.runner.backend.build_metadata)
    return engine, stand_in


def resolve(engine: LLMEngine, path: str):
    target = engine
    for name in filter(None, path.split(".")):
        target = getattr(target, name)
    return target


def run(num_seqs: int, num_blocks: int, vocab: int, steps: int, seed: int, stages: bool) -> dict:
    """Steady num_seqs in flight for `steps` steps after a warm-up; per-step figures of the pure decode steps."""
    engine, stand_in = stand_in_engine(num_seqs, num_blocks, vocab)
    core = Clock()
    for name in SCHEDULER_CALLS:
        setattr(engine.scheduler, name, core.wrap(getattr(engine.scheduler, name)))
    for name in BLOCK_MANAGER_CALLS:
        setattr(engine.block_manager, name, core.wrap(getattr(engine.block_manager, name)))
    threshold = gc.get_threshold()
    settle_garbage_collector()  # as LLM does once the model is loaded
    stage_clocks: dict[str, Clock] = {}
    if stages:
        for label, path, method in STAGES:
            owner = resolve(engine, path)
            if hasattr(owner, method):
                stage_clocks[label] = clock = Clock()
                setattr(owner, method, clock.wrap(getattr(owner, method)))
    rng = random.Random(seed)
    for _ in range(num_seqs):
        engine.add_request(*new_request(rng, residual=True))
    full_collections = []
    collector = {"time": 0.0, "start": 0.0}

    def on_gc(phase: str, info: dict) -> None:
        now = time.thread_time()
        if phase == "start":
            collector["start"] = now
        else:
            collector["time"] += now - collector["start"]
        if info["generation"] == 2:
            full_collections.append((phase, time.perf_counter()))

    records: list[dict] = []
    peak_used = 0
    warmup = 30
    gc.callbacks.append(on_gc)
    try:
        for index in range(warmup + steps):
            if index == warmup:
                full_collections.clear()
            marks = (core.total, stand_in.clock.total, {k: c.total for k, c in stage_clocks.items()},
                     collector["time"])
            start = time.thread_time()
            outputs = engine.step()
            elapsed = time.thread_time() - start
            record = engine.step_history[-1]
            peak_used = max(peak_used, engine.block_manager.num_used_blocks)
            if index >= warmup and record.num_prefill_tokens == 0 and record.num_preempted == 0:
                records.append({"index": index - warmup, "seqs": record.num_seqs, "step": elapsed,
                                "core": core.total - marks[0],
                                "model": stand_in.clock.total - marks[1], "gc": collector["time"] - marks[3],
                                "stages": {k: c.total - marks[2][k] for k, c in stage_clocks.items()}})
            for output in outputs:
                if output.finished:
                    engine.add_request(*new_request(rng))
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
        gc.set_threshold(*threshold)
    starts = [t for phase, t in full_collections if phase == "start"]
    stops = [t for phase, t in full_collections if phase == "stop"]
    return {"records": records, "peak_used_blocks": peak_used, "preemptions": engine.num_preemptions,
            "full_collections": len(starts), "full_collection_ms": 1000 * sum(b - a for a, b in zip(starts, stops))}


def summarize(result: dict) -> dict:
    records = result["records"]
    if not records:
        return {"decode_steps": 0}
    seqs = statistics.median(r["seqs"] for r in records)
    core = statistics.median(r["core"] for r in records)
    outside = statistics.median(r["step"] - r["model"] for r in records)
    stages = {k: statistics.median(r["stages"][k] for r in records) for k in records[0]["stages"]}
    gc_label = "garbage collector, all generations (mean; overlaps the stages it ran in)"
    stages[gc_label] = statistics.mean(r["gc"] for r in records)
    return {"decode_steps": len(records), "seqs": seqs, "core_us": core * 1e6, "core_us_per_seq": core * 1e6 / seqs,
            "outside_us": outside * 1e6, "outside_us_per_seq": outside * 1e6 / seqs,
            "stages_us": {k: v * 1e6 for k, v in stages.items()}, "peak_used_blocks": result["peak_used_blocks"],
            "preemptions": result["preemptions"], "full_collections": result["full_collections"],
            "full_collection_ms": result["full_collection_ms"]}


def drift(result: dict, width: int) -> list[float]:
    """The step outside the model, us per sequence, median over each window of `width` measured steps."""
    by_window: dict[int, list[float]] = defaultdict(list)
    for r in result["records"]:
        by_window[r["index"] // width].append((r["step"] - r["model"]) * 1e6 / r["seqs"])
    return [statistics.median(by_window[w]) for w in sorted(by_window)]


def argmax_us(num_seqs: int, repeats: int = 15) -> float:
    """One argmax over a fresh [num_seqs, VOCAB] float32 tensor, median microseconds."""
    logits = torch.rand(num_seqs, VOCAB)
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        logits.argmax(dim=-1)
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e6


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def spread(runs: list[dict], key: str) -> str:
    values = sorted(run[key] for run in runs)
    middle = f"{statistics.median(values):.2f}"
    return f"{middle} ({values[0]:.2f}-{values[-1]:.2f})" if len(values) > 1 else middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256, 512])
    parser.add_argument("--steps", type=int, default=300, help="measured steps with the one-token vocabulary")
    parser.add_argument("--vocab-steps", type=int, default=60, help="measured steps with the full vocabulary")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration (medians of medians)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-pressure", action="store_true", help="only the pool that never preempts")
    parser.add_argument("--profile", type=int, default=256, help="N whose steps are split into stages")
    parser.add_argument("--json-line", action="store_true", help="one quick run per N, one JSON line (module doc)")
    parser.add_argument("--steady-steps", type=int, default=2000,
                        help="a longer run at the --profile N (vocab 1, roomy), in windows of 250 steps: the step "
                             "outside the model while contexts grow to their steady state (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the machine's two cores are shared; one thread keeps the figures steady
    if args.json_line:
        print(json.dumps(json_line(args.sizes, args.steps, args.seed)))
        return
    info = machine()
    info["load_average"] = os.getloadavg()
    print_machine(info)
    print(f"load average at start: {info['load_average'][0]:.2f} {info['load_average'][1]:.2f} "
          f"{info['load_average'][2]:.2f}", flush=True)
    results: dict = defaultdict(lambda: defaultdict(list))
    nano = step_overhead_alone.load_nano_vllm()
    print("nano-vllm-fork: " + ("installed, run side by side" if nano else "not installed, left out"), flush=True)
    for num_seqs in args.sizes:
        roomy_blocks = num_seqs * -(-2000 // BLOCK_SIZE) + 16
        for _ in range(args.repeats):
            gc.collect()  # the previous configuration's engines and requests are gone before each run starts
            alone = results[f"alone N={num_seqs}"]
            alone["localserve"].append(step_overhead_alone.run_localserve(
                new_request, num_seqs, roomy_blocks, args.steps, args.seed, VOCAB))
            if nano:
                gc.collect()
                alone["nano-vllm-fork"].append(step_overhead_alone.run_nano_vllm(
                    nano, new_request, num_seqs, roomy_blocks, args.steps, args.seed, VOCAB))
        print(f"N={num_seqs} alone: {dict(results[f'alone N={num_seqs}'])}", flush=True)
        pools = [("roomy", roomy_blocks)]
        for pool, num_blocks in pools:
            for vocab, steps in ((1, args.steps), (VOCAB, args.vocab_steps)):
                for _ in range(args.repeats):
                    summary = summarize(run(num_seqs, num_blocks, vocab, steps, args.seed,
                                            stages=num_seqs == args.profile))
                    results[f"{pool} N={num_seqs}"][f"vocab {vocab}"].append(summary)
                    print(f"N={num_seqs} {pool} pool ({num_blocks} blocks) vocab {vocab}: {summary}", flush=True)
                if pool == "roomy" and vocab == 1 and num_seqs > 1 and not args.no_pressure:
                    # A request alone must still fit: at N=1 a 0.6x pool would refuse the longest ones.
                    peak = max(r["peak_used_blocks"] for r in results[f"roomy N={num_seqs}"]["vocab 1"])
                    pools.append(("0.6x peak", int(0.6 * peak)))
        if num_seqs == args.profile and args.steady_steps:
            for _ in range(args.repeats):
                windows = drift(run(num_seqs, roomy_blocks, 1, args.steady_steps, args.seed, stages=False), 250)
                results[f"steady N={num_seqs}"]["windows"].append(windows)
                print(f"N={num_seqs} steady state, us/seq per 250 steps: {[round(w, 2) for w in windows]}", flush=True)
        results[f"argmax N={num_seqs}"]["us"].append(argmax_us(num_seqs))
    info["load_average_end"] = os.getloadavg()
    print_tables(results, args)
    print(f"\nraw numbers: {save_raw('step_overhead', info, results)}")
    print(f"load average at end: {info['load_average_end'][0]:.2f} {info['load_average_end'][1]:.2f} "
          f"{info['load_average_end'][2]:.2f}")
    final = results.get("alone N=256", {}).get("localserve")
    if final and all(run["decode_steps"] for run in final):
        print(f"scheduler+block manager: {median_of(final, 'core_us_per_seq'):.2f} us/seq/step at N=256")


def json_line(sizes: list[int], steps: int, seed: int) -> dict:
    """Per N, µs per sequence per pure decode step: the scheduler + block manager alone (median and mean),
    in the step, and the step outside the model; and which localserve ran."""
    import localserve

    line: dict = {"localserve": localserve.__file__}
    for num_seqs in sizes:
        roomy_blocks = num_seqs * -(-2000 // BLOCK_SIZE) + 16
        gc.collect()
        alone = step_overhead_alone.run_localserve(new_request, num_seqs, roomy_blocks, steps, seed, VOCAB)
        gc.collect()
        step = summarize(run(num_seqs, roomy_blocks, 1, steps, seed, stages=False))
        line[str(num_seqs)] = {"alone_us_per_seq": alone["core_us_per_seq"], "alone_mean_us_per_seq":
                               alone["mean_us_per_seq"], "in_step_us_per_seq": step["core_us_per_seq"],
                               "outside_us_per_seq": step["outside_us_per_seq"]}
    return line


def print_tables(results: dict, args) -> None:
    print("\nscheduler + block manager alone, roomy pool, us per sequence per pure decode step "
          "(median of the runs' medians, range over the runs):")
    rows = []
    for n in args.sizes:
        alone = results[f"alone N={n}"]
        ours = alone["localserve"]
        if not all(run["decode_steps"] for run in ours):
            continue
        theirs = alone.get("nano-vllm-fork")
        rows.append([n, f"{median_of(ours, 'core_us'):.0f}", spread(ours, "core_us_per_seq"),
                     spread(ours, "mean_us_per_seq")]
                    + ([f"{median_of(theirs, 'core_us'):.0f}", spread(theirs, "core_us_per_seq"),
                        spread(theirs, "mean_us_per_seq")] if theirs else []))
    with_nano = bool(results[f"alone N={args.sizes[0]}"].get("nano-vllm-fork"))
    print(markdown_table(["N", "localserve us/step", "us/seq", "mean us/seq"]
                         + (["nano-vllm-fork us/step", "us/seq", "mean us/seq"] if with_nano else []), rows))
    if all(f"alone N={n}" in results for n in (64, 512)):
        for name in ("localserve", "nano-vllm-fork"):
            if name in results["alone N=64"]:
                ratios = [median_of(results["alone N=512"][name], key) / median_of(results["alone N=64"][name], key)
                          for key in ("core_us_per_seq", "mean_us_per_seq")]
                print(f"{name}: N=512 / N=64 = {ratios[0]:.2f}x (of the means: {ratios[1]:.2f}x)")
    headers = ["pool", "N", "running", "decode steps", "preemptions", "sched+BM in the step, us/seq",
               "outside model, vocab 1: us/step", "us/seq", "vocab 49,152: us/step", "us/seq",
               "vocab-sized work us/step", "one argmax us", "ratio", "full GCs"]
    rows = []
    for key, by_vocab in results.items():
        if not key.startswith(("roomy", "0.6x")):
            continue
        pool, n = key.rsplit(" N=", 1)
        small, full = by_vocab["vocab 1"], by_vocab[f"vocab {VOCAB}"]
        if not all(r["decode_steps"] for r in small + full):
            rows.append([pool, n, "-", 0] + ["-"] * 10)
            continue
        vocab_work = median_of(full, "outside_us") - median_of(small, "outside_us")
        argmax = results[f"argmax N={n}"]["us"][0]
        gcs = sum(r["full_collections"] for r in small + full)
        rows.append([pool, n, f"{median_of(small, 'seqs'):.0f}", sum(r["decode_steps"] for r in small),
                     sum(r["preemptions"] for r in small), spread(small, "core_us_per_seq"),
                     f"{median_of(small, 'outside_us'):.0f}", spread(small, "outside_us_per_seq"),
                     f"{median_of(full, 'outside_us'):.0f}", spread(full, "outside_us_per_seq"),
                     f"{vocab_work:.0f}", f"{argmax:.0f}", f"{vocab_work / argmax:.2f}x", gcs])
    print("\nthe engine's step outside the model, per pure decode step (medians of the runs' medians; ranges):")
    print(markdown_table(headers, rows))
    steady = results.get(f"steady N={args.profile}")
    if steady:
        print(f"\nthe step outside the model, vocab 1, roomy pool, N={args.profile}, us/seq per window of 250 measured "
              "steps (after 30 of warm-up), each run and their median:")
        runs = steady["windows"]
        print(markdown_table(["steps"] + [f"run {i + 1}" for i in range(len(runs))] + ["median"], [
            [f"{250 * w}-{250 * (w + 1)}"] + [f"{run[w]:.2f}" for run in runs]
            + [f"{statistics.median(run[w] for run in runs):.2f}"]
            for w in range(min(map(len, runs)))]))
    profile = results.get(f"roomy N={args.profile}")
    if profile:
        print(f"\nwhere the time of a pure decode step goes, roomy pool, N={args.profile} (us per step, first run):")
        stage_rows = []
        for vocab_key in ("vocab 1", f"vocab {VOCAB}"):
            summary = profile[vocab_key][0]
            if not summary["decode_steps"]:
                continue
            named = sum(v for k, v in summary["stages_us"].items() if not k.startswith("garbage"))
            for label, value in summary["stages_us"].items():
                stage_rows.append([vocab_key, label, f"{value:.0f}", f"{value / summary['seqs']:.2f}"])
            stage_rows.append([vocab_key, "rest of the step (engine loop, stop rules, bookkeeping)",
                               f"{summary['outside_us'] - named:.0f}",
                               f"{(summary['outside_us'] - named) / summary['seqs']:.2f}"])
        print(markdown_table(["vocabulary", "stage", "us/step", "us/seq"], stage_rows))


if __name__ == "__main__":
    main()
