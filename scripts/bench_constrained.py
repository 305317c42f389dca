"""Constrained decoding's cost (issue 23): decode throughput with every row under a JSON-schema grammar
against the same workload unconstrained, at 1, 16 and 64 rows, on the default model, in one run.

The workload: N requests, each its own chat prompt asking for people as JSON, greedy, ignore_eos,
decoding `--steps` measured steps after their prefill (so every step is N decode rows). Constrained, each
request's grammar is a JSON array of at least 100 person objects (a strict schema with strings,
integers, an enum and a nested array), which no request can finish within the steps: every measured
step masks all N rows. The two workloads run on two engines in one process, their decode steps in
back-to-back pairs (which one goes first alternates), `--repeats` times. Throughput is N over the
median step; the ratio is the median over the pairs of unconstrained step time over constrained step
time, which a machine shared with other work disturbs far less than either alone (both steps of a
pair meet the same load).

Mask time per token is the worker's fill of a step's masks (llguidance's parallel fill and the bias
rows, engine/grammar_masks.py) divided by its rows: what the step would add if it filled them after
the forward. "step waited" is what the step did wait for the fill after the forward (the fill runs
while the model does), and "apply" the copy and add of the bias on the logits.

    python scripts/bench_constrained.py [--rows 1 16 64] [--steps 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchlib import machine, markdown_table, percentile, print_machine, save_raw

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.grammar import GrammarSpec
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.default_model import resolve_default_model
from localserve.loading.hf import load_model
from localserve.tokenizer.tokenizer import Tokenizer

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "skills"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
                         "skills": {"type": "array", "items": {"type": "string"}}}}
GRAMMAR = GrammarSpec.json_schema({"type": "array", "minItems": 100, "items": PERSON})
TARGET_ROWS, TARGET_RATIO = 16, 0.90


class Workload:
    """`rows` requests prefilled on their own engine, ready for decode steps."""

    def __init__(self, model, tokenizer: Tokenizer, rows: int, steps: int, constrained: bool) -> None:
        prompts = [tokenizer.encode_chat([{"role": "user", "content": f"List people as JSON, starting with person "
                                                                      f"number {index}."}]) for index in range(rows)]
        longest = max(map(len, prompts)) + steps + 8
        self.rows = rows
        self.engine = build_engine(model, tokenizer, EngineConfig(
            num_kv_blocks=rows * -(-longest // 16) + 16, max_num_seqs=rows,
            max_num_batched_tokens=max(512, sum(map(len, prompts)))))
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True,
                                grammar=GRAMMAR if constrained else None)
        for prompt in prompts:
            self.engine.add_request(prompt, params)
        self.engine.step()  # every prompt at once, and the first tokens
        assert all(request.seqs[0].num_output_tokens == 1 for request in self.engine.requests.values())
        self.engine.grammar_masks.timings.clear()
        self.step_s: list[float] = []

    def step(self) -> None:
        start = time.perf_counter()
        self.engine.step()
        self.step_s.append(time.perf_counter() - start)

    def check(self, steps: int) -> None:
        generated = sum(request.seqs[0].num_output_tokens - 1 for request in self.engine.requests.values())
        assert generated == self.rows * steps, "a request ended or skipped a step inside the measurement"


def run(model, tokenizer: Tokenizer, rows: int, steps: int) -> tuple[list[float], list[float], list]:
    """The two workloads side by side, their decode steps in pairs (which goes first alternates): the step
    times of each, and the constrained engine's mask timings."""
    free, constrained = Workload(model, tokenizer, rows, steps, False), Workload(model, tokenizer, rows, steps, True)
    for index in range(steps):
        for workload in (free, constrained) if index % 2 else (constrained, free):
            workload.step()
    free.check(steps)
    constrained.check(steps)
    return free.step_s, constrained.step_s, list(constrained.engine.grammar_masks.timings)


def summary(rows: int, free_s: list[float], constrained_s: list[float], timings: list) -> dict:
    """Medians over steps: throughput from the median step; the ratio is the median over pairs of steps
    taken back to back (a machine shared with other work slows both of a pair alike)."""
    fills = [t.fill_s for t in timings]
    per_token = [t.fill_s / t.num_rows for t in timings]
    return {"free_tokens_per_s": rows / statistics.median(free_s),
            "constrained_tokens_per_s": rows / statistics.median(constrained_s),
            "ratio": statistics.median(f / c for f, c in zip(free_s, constrained_s)),
            "ratio_p25": percentile([f / c for f, c in zip(free_s, constrained_s)], 25),
            "ratio_p75": percentile([f / c for f, c in zip(free_s, constrained_s)], 75),
            "mask_per_token_s": [percentile(per_token, 50), percentile(per_token, 99)],
            "fill_s": [percentile(fills, 50), percentile(fills, 99)],
            "wait_s": [percentile([t.wait_s for t in timings], 50), percentile([t.wait_s for t in timings], 99)],
            "apply_s": [percentile([t.apply_s for t in timings], 50), percentile([t.apply_s for t in timings], 99)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    info = machine()
    print_machine(info)
    path = resolve_default_model()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(path, dtype=torch.float32, device=device)
    tokenizer = Tokenizer.from_path(path)
    results = {}
    for rows in args.rows:
        free_s, constrained_s, timings = [], [], []
        for _ in range(args.repeats):
            free, constrained, masks = run(loaded.model, tokenizer, rows, args.steps)
            free_s += free
            constrained_s += constrained
            timings += masks
        results[rows] = summary(rows, free_s, constrained_s, timings)
        print(f"{rows} rows: {results[rows]['free_tokens_per_s']:.1f} tokens/s unconstrained, "
              f"{results[rows]['constrained_tokens_per_s']:.1f} constrained", flush=True)
    headers = ["rows", "unconstrained tokens/s", "constrained tokens/s", "ratio (p25-p75)",
               "mask per token: median / p99 (us)", "fill per step: median / p99 (ms)",
               "step waited: median / p99 (ms)", "apply: median / p99 (ms)"]
    table = [[rows, f"{r['free_tokens_per_s']:.1f}", f"{r['constrained_tokens_per_s']:.1f}",
              f"{r['ratio']:.3f} ({r['ratio_p25']:.3f}-{r['ratio_p75']:.3f})",
              " / ".join(f"{v * 1e6:.1f}" for v in r["mask_per_token_s"]),
              " / ".join(f"{v * 1e3:.3f}" for v in r["fill_s"]), " / ".join(f"{v * 1e3:.3f}" for v in r["wait_s"]),
              " / ".join(f"{v * 1e3:.3f}" for v in r["apply_s"])] for rows, r in results.items()]
    print()
    print(markdown_table(headers, table))
    if TARGET_ROWS in results:
        ratio = results[TARGET_ROWS]["ratio"]
        verdict = "met" if ratio >= TARGET_RATIO else "not met"
        print(f"\ntarget at {TARGET_ROWS} rows: constrained >= {TARGET_RATIO:.0%} of unconstrained throughput: "
              f"{ratio:.1%}, {verdict}")
    raw = {"steps": args.steps, "repeats": args.repeats, "device": device, "rows": results}
    print(f"raw numbers: {save_raw('constrained', info, raw)}")


if __name__ == "__main__":
    main()
