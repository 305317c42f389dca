"""Reliability under heavy load: the full version of tests/server/test_load.py, with its figures.

For each preemption mode, a server on loopback (a tiny random model with a word-level chat tokenizer,
written to a temporary folder; torch on one thread) takes a warm-up round and then `--rounds` rounds
of `--clients` clients at once (`--http-fraction` of them stream chat completions over HTTP keep-alive,
the others are websocket clients; multi-turn conversations with previous_response_id, lanes,
random sampling, 10% cancelling and 10% disconnecting mid-stream) with a KV pool small enough to
preempt. After each round: no lost response, the block manager's books balanced with every block free
or cached, no open connection (the num_connections gauge), the process's RSS. At the end every greedy
answer of every round is sent again alone and compared. Prints a Markdown table for
docs/BENCHMARKS.md ("Reliability").

    python scripts/load_test.py [--clients 256] [--rounds 3] [--max-output-tokens 32] [--blocks 12]
        [--http-fraction 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchlib import import_test_helpers

import_test_helpers()  # tests.helpers, without the repository root on sys.path

from localserve.engine.config import EngineConfig  # noqa: E402
from localserve.llm import LLM  # noqa: E402
from tests.helpers.load import LoadConfig, replay_alone, run_load  # noqa: E402
from tests.helpers.server import running_server, wait_until_idle, write_tiny_chat_model  # noqa: E402


def rss_mib() -> float:
    """Resident memory once garbage is collected (the engine collects the old generation rarely)."""
    gc.collect()
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def wait_for_no_connections(server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while server.server.num_connections:
        if time.monotonic() > deadline:
            raise SystemExit(f"{server.server.num_connections} connections still open after the load")
        time.sleep(0.1)


def run_mode(model_dir: Path, mode: str, args: argparse.Namespace) -> dict:
    llm = LLM(str(model_dir), device="cpu", engine_config=EngineConfig(
        num_kv_blocks=args.blocks, max_num_seqs=args.slots, max_num_batched_tokens=256, preemption_mode=mode,
        max_model_len=512))
    load = LoadConfig(num_clients=args.clients, min_turns=args.min_turns, max_turns=args.max_turns,
                      max_output_tokens=args.max_output_tokens, http_fraction=args.http_fraction)
    row = {"mode": mode, "responses": 0, "lost": 0, "greedy": 0, "mismatches": 0, "rss": [], "seconds": [],
           "outcomes": {}}
    with running_server(llm, max_connections=args.clients) as server:
        engine_thread = server.server.models.serving_now().engine
        greedy = []
        for round_index in range(1 + args.rounds):  # round 0 warms up: bounded buffers fill, arenas grow
            report = asyncio.run(run_load(server.port, dataclasses.replace(load, seed=round_index)))
            wait_until_idle(engine_thread, timeout=120)  # check_integrity(); every block free or cached
            wait_for_no_connections(server)
            print(f"{mode} round {round_index}: {report.duration_s:.1f} s, {dict(report.outcomes())}, "
                  f"RSS {rss_mib():.1f} MiB", file=sys.stderr)
            row["seconds"].append(report.duration_s)
            row["rss"].append(rss_mib())
            row["responses"] += len(report.turns)
            row["lost"] += len(report.lost)
            for outcome, count in report.outcomes().items():
                row["outcomes"][outcome] = row["outcomes"].get(outcome, 0) + count
            greedy += [turn for turn in report.turns if turn.greedy and turn.outcome in ("completed", "incomplete")]
        counters = engine_thread.call(lambda engine: engine.stats().counters).result(60)
        start = time.monotonic()
        mismatches = asyncio.run(replay_alone(server.port, greedy))
        print(f"{mode}: replayed {len(greedy)} greedy answers alone in {time.monotonic() - start:.1f} s",
              file=sys.stderr)
    row.update(greedy=len(greedy), mismatches=len(mismatches), preemptions=counters.num_preemptions,
               by_mode=(counters.num_preemptions_recompute, counters.num_preemptions_swap),
               generated=counters.num_generation_tokens)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-turns", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=12, help="KV blocks of 16 tokens (small: preemption)")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--http-fraction", type=float, default=0.25, help="share of clients over HTTP")
    parser.add_argument("--modes", nargs="+", default=["recompute", "swap"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # every preemption is a warning: thousands of lines
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        model_dir = write_tiny_chat_model(Path(folder))
        rows = [run_mode(model_dir, mode, args) for mode in args.modes]
    print("| mode | responses | outcomes | lost | preemptions (recompute / swap) | greedy replayed alone: "
          "differ | round time (s) | RSS after each round (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        outcomes = ", ".join(f"{name} {count}" for name, count in sorted(row["outcomes"].items()))
        rss = " / ".join(f"{value:.0f}" for value in row["rss"])
        measured = row["rss"][1:]
        print(f"| {row['mode']} | {row['responses']} | {outcomes} | {row['lost']} | {row['preemptions']} "
              f"({row['by_mode'][0]} / {row['by_mode'][1]}) | {row['greedy']}: {row['mismatches']} | "
              f"{' / '.join(f'{s:.0f}' for s in row['seconds'])} | {rss} (after warm-up: "
              f"{100 * (max(measured) / min(measured) - 1):.1f}% spread) |")


if __name__ == "__main__":
    main()
