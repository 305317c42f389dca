"""A fixed scene for the snapshot tests (and the screenshot in docs/): a busy pool under pressure."""

from __future__ import annotations

import random
from typing import Any

from tests.helpers.monitor_frames import event_entry, hello_frame, request_entry, snapshot_frame

NUM_BLOCKS = 1024
NUM_CPU_BLOCKS = 64


def busy_scene(num_snapshots: int = 40) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A hello frame and `num_snapshots` snapshots, 0.5 s apart, of a pool filling up until it thrashes."""
    rng = random.Random(7)
    snapshots = []
    for index in range(num_snapshots):
        fill = min(1.0, 0.15 + index / (num_snapshots * 0.6))
        states = ["."] * NUM_BLOCKS
        for block in rng.sample(range(NUM_BLOCKS), int(NUM_BLOCKS * 0.1)):
            states[block] = "c"
        used = rng.sample(range(NUM_BLOCKS), int(NUM_BLOCKS * fill * 0.97))
        for block in used:
            states[block] = "u"
        shared = [0, 1, 2, 3, 4, 5]
        for block in shared:
            states[block] = "s"
        r1_tails = [[10, 11], [12, 13]]
        r3_blocks = [40 + i for i in range(20)]
        r2_blocks = [100 + i for i in range(9)]
        for block in [b for tail in r1_tails for b in tail] + r3_blocks + r2_blocks:
            states[block] = "u"
        requests = [
            request_entry("r1", "decode", [shared + tail for tail in r1_tails], num_prompt_tokens=96,
                          num_output_tokens=20 + index, num_cached_tokens=64, tokens_per_s=11.2),
            request_entry("r3", "decode", [r3_blocks], num_prompt_tokens=300, num_output_tokens=5 + index,
                          num_preemptions=2 if index > 30 else 0, tokens_per_s=9.8),
            request_entry("r2", "prefill", [r2_blocks], num_prompt_tokens=400, num_computed_prompt_tokens=144,
                          num_output_tokens=0, tokens_per_s=0.0),
            request_entry("r4", "preempted", [], num_prompt_tokens=50, num_output_tokens=33, num_preemptions=1,
                          tokens_per_s=7.5),
            request_entry("r5", "waiting", [], num_prompt_tokens=20, num_computed_prompt_tokens=0,
                          num_output_tokens=0, tokens_per_s=0.0),
        ]
        cpu_states = "w" * min(NUM_CPU_BLOCKS, index) + "." * max(0, NUM_CPU_BLOCKS - index)
        num_preemptions = max(0, index - 28) * 2
        time_s = index * 0.5
        events = [event_entry(2 * index, "admitted", f"r{6 + index}", time_s, num_prompt_tokens=40 + index),
                  event_entry(2 * index + 1, "preempted" if index > 28 else "prefix_hit", "r4", time_s,
                              **({"mode": "recompute"} if index > 28 else {"num_cached_tokens": 32}))]
        snapshots.append(snapshot_frame("".join(states), cpu_states=cpu_states, requests=requests, time_s=time_s,
                                        num_preemptions=num_preemptions, events=events,
                                        missed_events=12 if index == num_snapshots - 3 else 0,
                                        generation_tokens=index * 40 + (index % 5) * 7, num_steps=10 * index,
                                        counters={"prefix_query_tokens": 200 * index,
                                                  "prefix_hit_tokens": 64 * index + 16 * (index % 3)},
                                        last_step_s=0.02 + 0.01 * (index % 4)))
    return hello_frame(NUM_BLOCKS, NUM_CPU_BLOCKS, max_num_seqs=4), snapshots


def fill_app(app, hello: dict[str, Any], snapshots: list[dict[str, Any]]) -> None:
    """Hand the app every frame, as the feed worker would."""
    from localserve.tui.feed import parse_hello, parse_snapshot

    typed_hello = parse_hello(hello)
    app.show_hello(typed_hello)
    for frame in snapshots:
        app.show_snapshot(parse_snapshot(frame, typed_hello))
