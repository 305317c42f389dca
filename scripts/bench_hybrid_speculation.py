"""Speculative decoding on a hybrid linear-attention model (issue 37): output tokens per second with drafts
verified over the Gated DeltaNet layers against none, side by side in one run, and what writing the kept
tokens' states after each verification costs.

A small random Qwen3.5 (the model of scripts/bench_state_reuse.py: hidden 512, 8 layers, 6 of them Gated
DeltaNet, transformers' own init, saved and loaded by localserve) on LLMEngine, on the CPU. A random model
copies nothing, so a real drafter's acceptance on it says nothing: the drafts come from an oracle that knows
each request's greedy continuation (tests/helpers/oracle_drafter.py) and plants a wrong token with chance
`--wrong` per drafted token (a draft is kept up to its first wrong token). The engine's own planner picks
how many tokens to draft (its cost model, as when serving), the verification is the real one, and the output
must equal the run without speculation token for token.

Columns: tokens/s without and with drafts (prefill included, the same greedy requests, engines taking
turns, medians of `--repeats`), their ratio, drafted tokens kept, tokens per verify row (1 + kept), and the
share of the run spent in `ModelRunner.settle_states` (making the kept tokens' states again from the state
the row read: the price of exactness over recurrent layers).

Usage: python scripts/bench_hybrid_speculation.py [--batches 1 4] [--wrong 0 0.2 0.5] [--prompt-tokens 200]
[--max-tokens 96] [--repeats 3] [--threads 1] [--dry-run] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_state_reuse import DRY_MODEL, MODEL, save_model
from benchlib import import_test_helpers, machine, markdown_table, print_machine

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model

import_test_helpers()  # tests.helpers, without the repository root on sys.path
from tests.helpers.oracle_drafter import OracleDrafter  # noqa: E402


def prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab_size) for _ in range(length)] for _ in range(count)]


def run(model, work: list[list[int]], max_tokens: int, drafter=None) -> tuple[float, list[list[int]], object, float]:
    """(seconds, each request's tokens, the engine, seconds in settle_states) of the requests run together."""
    config = EngineConfig(num_kv_blocks=512, max_num_seqs=len(work), max_num_batched_tokens=256,
                          spec_type="ngram" if drafter else None, spec_tokens=8)
    engine = build_engine(model, None, config)
    settle_s = [0.0]
    if drafter is not None:
        engine.scheduler.speculation.drafter = drafter
        settle = engine.runner.settle_states

        def timed_settle(kept):
            start = time.perf_counter()
            settle(kept)
            settle_s[0] += time.perf_counter() - start

        engine.runner.settle_states = timed_settle
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in work]
    final = {}
    while engine.has_unfinished_requests():
        final.update((output.request_id, output) for output in engine.step() if output.finished)
    seconds = time.perf_counter() - start
    return seconds, [list(final[request_id].outputs[0].token_ids) for request_id in ids], engine, settle_s[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--wrong", type=float, nargs="+", default=[0.0, 0.2, 0.5],
                        help="chance of a planted wrong token per drafted token")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, short requests, one repeat")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = DRY_MODEL if args.dry_run else MODEL
    if args.dry_run:
        args.batches, args.wrong, args.prompt_tokens, args.max_tokens, args.repeats = [1, 2], [0.0, 0.5], 24, 12, 1
    print_machine(machine())
    with tempfile.TemporaryDirectory() as folder:
        model = load_model(save_model(Path(folder), **shape), dtype=torch.float32).model
    run(model, prompts(1, 20, shape["vocab_size"], seed=99), 4)  # warm-up: one-off costs out of the first row
    rows = []
    for batch in args.batches:
        work = prompts(batch, args.prompt_tokens, shape["vocab_size"], seed=batch)
        _, expected, _, _ = run(model, work, args.max_tokens)
        whole = [prompt + tokens for prompt, tokens in zip(work, expected)]
        for wrong in args.wrong:
            off_s, on_s, same, kept, drafted, verifies, settle = [], [], True, 0, 0, 0, 0.0
            for repeat in range(args.repeats):
                seconds, tokens, _, _ = run(model, work, args.max_tokens)
                off_s.append(seconds)
                same &= tokens == expected
                drafter = OracleDrafter(whole, shape["vocab_size"], wrong=wrong, seed=repeat)
                seconds, tokens, engine, settle_s = run(model, work, args.max_tokens, drafter)
                on_s.append(seconds)
                same &= tokens == expected
                totals = engine.scheduler.speculation.totals
                kept, drafted, verifies = (kept + totals.num_accepted_tokens, drafted + totals.num_draft_tokens,
                                           verifies + totals.num_drafts)
                settle += settle_s / seconds
            output_tokens = batch * args.max_tokens
            off, on = output_tokens / statistics.median(off_s), output_tokens / statistics.median(on_s)
            rows.append([batch, f"{wrong:.0%}", f"{off:.1f}", f"{on:.1f}", f"**{on / off:.2f}x**",
                         f"{kept / drafted:.0%}" if drafted else "-", f"{1 + kept / verifies:.2f}" if verifies else "-",
                         f"{settle / args.repeats:.1%}", "yes" if same else "NO"])
            print(rows[-1], flush=True)
    table = markdown_table(["batch", "drafted tokens wrong", "off tok/s", "on tok/s", "speed-up", "drafts kept",
                            "tokens/verify", "in settle_states", "same tokens"], rows)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
