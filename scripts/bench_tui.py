"""TUI benchmark: how big a monitor frame of a 65,536-block pool is, and how long the TUI takes to draw it.

    python scripts/bench_tui.py [--num-blocks 65536] [--frames 15] [--seed 0]

Prints a markdown table (docs/BENCHMARKS.md, "TUI"). Takes about a minute on 2 cores.

Two pools, each as 15 different seeded frames built the way the server sends them (docs/PROTOCOL.md):
- "fragmented": every block's state drawn at random (the run-length encoding saves nothing), 256
  requests whose block tables cover 3/4 of the pool, a tenth of them new in each frame (the others
  keep their label and generate 8 tokens a frame). The worst case for size and decoding.
- "runs": the same requests holding contiguous runs of blocks, cached blocks in runs between them.

For each frame, in a headless app of the given terminal size that has seen the hello frame: `parse`
is json.loads plus the typed parsing (block states decoded); `apply` is `MonitorApp.show_snapshot`
(the map's cells and strips, the slots table, the trends, the event log); `frame` is the CPU time from
the frame's text to the screen painted and the app idle again, which includes both plus Textual's
layout and compositing and the encoding of each screen update as terminal output (a headless app
skips only that step; `TerminalCostApp` puts it back). CPU time, not wall time: the app paints on its
own refresh timer, and waiting for it is not work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from benchlib import import_test_helpers

import_test_helpers()  # tests.helpers, without the repository root on sys.path

from localserve.tui.app import MonitorApp  # noqa: E402
from localserve.tui.feed import parse_hello, parse_snapshot  # noqa: E402

from tests.helpers.monitor_frames import hello_frame, request_entry, snapshot_frame  # noqa: E402

NUM_REQUESTS = 256
SIZES = ((80, 24), (160, 48), (240, 70))


def build_frames(num_blocks: int, num_frames: int, fragmented: bool, seed: int) -> list[str]:
    """`num_frames` snapshot frames (JSON text) of a pool of `num_blocks`."""
    rng = random.Random(seed)
    frames = []
    blocks_per_request = num_blocks * 3 // 4 // NUM_REQUESTS
    for index in range(num_frames):
        if fragmented:
            order = list(range(num_blocks))
            rng.shuffle(order)
            states = [rng.choice(".cus") for _ in range(num_blocks)]
        else:
            order = list(range(num_blocks))
            states = ["u"] * (blocks_per_request * NUM_REQUESTS) + ["c"] * (num_blocks // 8)
            states += ["."] * (num_blocks - len(states))
        # A tenth of the requests finish and are replaced between two frames; the others keep their label.
        requests = [request_entry(f"r{r + NUM_REQUESTS * (index if r < NUM_REQUESTS // 10 else 0)}", "decode",
                                  [order[r * blocks_per_request:(r + 1) * blocks_per_request]],
                                  num_prompt_tokens=1000, num_output_tokens=index * 8 + r % 7,
                                  tokens_per_s=rng.uniform(5, 20))
                    for r in range(NUM_REQUESTS)]
        events = [{"seq": index * 10 + e, "time": 1764400000.0 + index, "event": "finished",
                   "request": f"r{e}", "reason": "stop"} for e in range(10)]
        frames.append(json.dumps(snapshot_frame("".join(states), requests=requests, time_s=index * 0.5,
                                                events=events, num_steps=index)))
    return frames


def count_runs(frame: str) -> int:
    """How many runs the frame's run-length encoded block states have."""
    return sum(not char.isdigit() for char in json.loads(frame)["blocks"])


class TerminalCostApp(MonitorApp):
    """Headless, yet paying what a terminal costs: each screen update is encoded as terminal output."""

    def _display(self, screen, renderable) -> None:  # Textual's hook; a headless app skips the encoding
        if renderable is not None and hasattr(renderable, "render_segments"):
            renderable.render_segments(self.console)
        super()._display(screen, renderable)


async def measure(frames: list[str], hello_json: dict, size: tuple[int, int]) -> dict[str, list[float]]:
    app = TerminalCostApp()
    timings: dict[str, list[float]] = {"parse": [], "apply": [], "frame": []}
    async with app.run_test(size=size) as pilot:
        hello = parse_hello(hello_json)
        app.show_hello(hello)
        await pilot.pause()
        for text in frames:
            await pilot.pause()
            start = time.process_time()
            snapshot = parse_snapshot(json.loads(text), hello)
            parsed = time.process_time()
            app.show_snapshot(snapshot)
            applied = time.process_time()
            await pilot.pause()
            done = time.process_time()
            timings["parse"].append(parsed - start)
            timings["apply"].append(applied - parsed)
            timings["frame"].append(done - start)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-blocks", type=int, default=65536)
    parser.add_argument("--frames", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    hello_json = hello_frame(args.num_blocks, max_num_seqs=NUM_REQUESTS)
    print(f"{args.num_blocks:,} blocks, {NUM_REQUESTS} requests; medians over {args.frames} frames (max in brackets)\n")
    print("| pool | frame size | runs | terminal | parse ms | apply ms | frame ms |")
    print("|---|---|---|---|---|---|---|")
    for name, fragmented in (("fragmented", True), ("runs", False)):
        frames = build_frames(args.num_blocks, args.frames, fragmented, args.seed)
        size_kib = statistics.median(len(frame) for frame in frames) / 1024
        runs = statistics.median(count_runs(frame) for frame in frames)
        for size in SIZES:
            timings = asyncio.run(measure(frames, hello_json, size))
            cells = " | ".join(f"{statistics.median(values) * 1000:.1f} ({max(values) * 1000:.1f})"
                               for values in timings.values())
            print(f"| {name} | {size_kib:,.0f} KiB | {runs:,.0f} | {size[0]}x{size[1]} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
