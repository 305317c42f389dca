"""Long-prompt interference: do background streams stall while a long prompt is prefilled?

Background chats stream tokens (16 by default on a CPU); an injector sends a long prompt at a fixed
period. Every token's arrival is timestamped. Four runs on the same model, one after the other:
baseline (no injector), injector with chunked prefill off, injector with chunked prefill on under a
token budget, and injector under the time budget (`--max-step-ms auto`: prefill only while a step stays
within about twice its decodes' time, the token budget `--time-budget-tokens` as an upper bound).
For each: median, p99, p99.9 and max inter-token latency (ITL) of the background streams, stalls
(gaps > 3x the baseline median), the long prompt's time to first token, and a PNG timeline of the
gaps with the injections marked.

    python scripts/bench_interference.py [--streams 16] [--prompt-tokens 1536] [--period 8] \
        [--duration 30] [--budget 32] [--max-step-ms auto] [--png docs/interference.png]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.default_model import resolve_default_model
from localserve.loading.hf import load_model


@dataclass
class RunResult:
    name: str
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (time since start, gap) per token
    injections: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)


def run(model, name: str, streams: int, duration: float, budget: int, chunked: bool,
        inject: bool, prompt_tokens: int, period: float, max_step_ms: float | str | None = None) -> RunResult:
    config = EngineConfig(num_kv_blocks=4096, enable_prefix_caching=False, max_num_seqs=streams + 4,
                          max_num_batched_tokens=budget, enable_chunked_prefill=chunked, max_step_ms=max_step_ms)
    engine = build_engine(model, None, config)
    background = {engine.add_request([1 + (i * 13 + j) % 4000 for j in range(32)],
                                     SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
                  for i in range(streams)}
    while any(r.num_prefill_tokens for r in list(engine.step_history)[-1:]) or not engine.step_history:
        engine.step()  # all streams admitted and decoding before the clock starts
    result = RunResult(name)
    start = time.perf_counter()
    last_token_at: dict[str, float] = {}
    injected: dict[str, float] = {}
    next_injection = period / 4
    rng = np.random.default_rng(0)
    while time.perf_counter() - start < duration:
        now = time.perf_counter() - start
        if inject and now >= next_injection:
            prompt = rng.integers(1, 40000, prompt_tokens).tolist()
            request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
            injected[request_id] = now
            result.injections.append(now)
            next_injection += period
        outputs = engine.step()
        now = time.perf_counter() - start
        for output in outputs:
            if output.request_id in background:
                if output.request_id in last_token_at:
                    result.gaps.append((now, now - last_token_at[output.request_id]))
                last_token_at[output.request_id] = now
            elif output.request_id in injected and output.outputs[0].token_ids:
                result.ttfts.append(now - injected.pop(output.request_id))
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return result


def summarize(result: RunResult, baseline_median: float) -> str:
    gaps = np.array([g for _, g in result.gaps]) * 1000
    p99, p999 = np.percentile(gaps, [99, 99.9])
    stalls = int((gaps > 3 * baseline_median * 1000).sum())
    ttft = f"{np.mean(result.ttfts):.2f} s" if result.ttfts else "-"
    return (f"| {result.name} | {np.median(gaps):.0f} | {p99:.0f} | {p999:.0f} | {gaps.max():.0f} | "
            f"{gaps.max() / (baseline_median * 1000):.1f}x | {stalls} | {ttft} |")


def plot(results: list[RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.6 * len(results)), sharex=True, sharey=True)
    for ax, result in zip(axes, results):
        times = [t for t, _ in result.gaps]
        ax.scatter(times, [g * 1000 for _, g in result.gaps], s=3)
        for t in result.injections:
            ax.axvline(t, color="red", linestyle="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("gap (ms)")
        ax.set_title(result.name, fontsize=10)
    axes[-1].set_xlabel("time (s); red: long prompt injected")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16 if not torch.cuda.is_available() else 32)
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--period", type=float, default=8.0, help="seconds between long prompts")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per run")
    parser.add_argument("--budget", type=int, default=32, help="token budget per step with chunking")
    parser.add_argument("--max-step-ms", default="auto", help="the time budget's run: auto or milliseconds")
    parser.add_argument("--time-budget-tokens", type=int, default=512,
                        help="the token budget bounding the time budget's run (the server's default)")
    parser.add_argument("--skip-unchunked", action="store_true", help="leave out the run without chunked prefill")
    parser.add_argument("--png", default="docs/interference.png")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(resolve_default_model(), device=device).model
    common = dict(streams=args.streams, duration=args.duration, prompt_tokens=args.prompt_tokens,
                  period=args.period)
    baseline = run(model, "baseline (no injector)", budget=args.budget, chunked=True, inject=False, **common)
    runs = [baseline]
    if not args.skip_unchunked:
        runs.append(run(model, "injector, chunked prefill off", budget=args.budget, chunked=False, inject=True,
                        **common))
    runs.append(run(model, f"injector, chunked prefill on (budget {args.budget})", budget=args.budget, chunked=True,
                    inject=True, **common))
    max_step_ms = args.max_step_ms if args.max_step_ms == "auto" else float(args.max_step_ms)
    runs.append(run(model, f"injector, time budget (--max-step-ms {args.max_step_ms}, at most "
                           f"{args.time_budget_tokens} tokens)", budget=args.time_budget_tokens, chunked=True,
                    inject=True, max_step_ms=max_step_ms, **common))
    baseline_median = float(np.median([g for _, g in baseline.gaps]))
    print(f"{args.streams} streams, long prompt {args.prompt_tokens} tokens every {args.period:.0f} s, "
          f"{args.duration:.0f} s per run, {device}, {torch.get_num_threads()} torch threads\n")
    print("| run | median ITL ms | p99 | p99.9 | max | max / baseline median | stalls (>3x) | long prompt TTFT |")
    print("|---|---|---|---|---|---|---|---|")
    for result in runs:
        print(summarize(result, baseline_median))
    plot(runs, args.png)
    print(f"\ntimeline: {args.png}")


if __name__ == "__main__":
    main()
