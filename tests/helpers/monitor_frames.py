"""Monitor frames as the server sends them (docs/PROTOCOL.md, "/v1/monitor"), built from plain state strings."""

from __future__ import annotations

import itertools
from typing import Any

BASE_TIME = 1764400000.0  # 2025-11-29 07:06:40 UTC


def run_length_encode(states: str) -> str:
    """`uuusscccc.` -> `u3s2c4.` (a run of one has no count)."""
    return "".join(char + (str(length) if length > 1 else "")
                   for char, length in ((char, len(list(run))) for char, run in itertools.groupby(states)))


def hello_frame(num_blocks: int = 64, num_cpu_blocks: int = 0, **changes: Any) -> dict[str, Any]:
    frame = {"type": "monitor.hello", "model": "SmolLM2-135M-Instruct", "block_size": 16, "num_blocks": num_blocks,
             "num_cpu_blocks": num_cpu_blocks, "max_num_seqs": 4, "max_num_batched_tokens": 512,
             "max_model_len": 2048, "cache_type_k": "fp16", "cache_type_v": "fp16",
             "kv_cache_bytes": num_blocks * 16 * 46080,
             "capacity": [{"format": "fp16", "bytes_per_token": 46080, "num_tokens": num_blocks * 16},
                          {"format": "q8_0", "bytes_per_token": 24480, "num_tokens": num_blocks * 16 * 46080 // 24480},
                          {"format": "q4", "bytes_per_token": 12240, "num_tokens": num_blocks * 16 * 46080 // 12240}]}
    return frame | changes


def request_entry(label: str, state: str, block_tables: list[list[int]], **changes: Any) -> dict[str, Any]:
    entry = {"label": label, "state": state, "num_prompt_tokens": 40, "num_computed_prompt_tokens": 40,
             "num_output_tokens": 12, "num_seqs": len(block_tables) or 1, "num_preemptions": 0,
             "num_cached_tokens": 0, "tokens_per_s": 12.5, "block_tables": block_tables}
    return entry | changes


def snapshot_frame(states: str, *, cpu_states: str = "", requests: list[dict[str, Any]] = (), time_s: float = 0.0,
                   num_preemptions: int = 0, events: list[dict[str, Any]] = (), missed_events: int = 0,
                   generation_tokens: int = 0, num_steps: int = 1, counters: dict[str, int] | None = None,
                   **gauge_changes: Any) -> dict[str, Any]:
    """A snapshot whose gauges agree with `states` (one character per block) unless told otherwise."""
    num_free, num_cached = states.count("."), states.count("c")
    num_used = states.count("u") + states.count("s")
    gauges = {"num_requests_running": sum(r["state"] in ("prefill", "decode") for r in requests),
              "num_requests_waiting": sum(r["state"] in ("waiting", "preempted") for r in requests),
              "num_requests_swapped": sum(r["state"] == "swapped" for r in requests),
              "kv_cache_usage_ratio": num_used / len(states), "num_free_blocks": num_free,
              "num_cached_blocks": num_cached, "num_used_blocks": num_used,
              "num_free_cpu_blocks": cpu_states.count("."), "last_step_s": 0.004, "last_step_tokens": 1}
    all_counters = {"num_preemptions": num_preemptions, "num_preemptions_recompute": num_preemptions,
                "num_preemptions_swap": 0, "num_swap_fallbacks": 0, "prefix_query_tokens": 120,
                "prefix_hit_tokens": 32, "num_prompt_tokens": 88, "num_generation_tokens": generation_tokens,
                "cow_copies": 0, "cached_block_evictions": 0, "num_requests_finished": 3,
                    "num_requests_failed": 0} | (counters or {})
    return {"type": "monitor.snapshot", "time": BASE_TIME + time_s, "num_steps": num_steps,
            "blocks": run_length_encode(states), "cpu_blocks": run_length_encode(cpu_states),
            "requests": list(requests), "gauges": gauges | gauge_changes, "counters": all_counters,
            "events": list(events), "missed_events": missed_events}


def event_entry(seq: int, event: str, request: str | None = "r1", time_s: float = 0.0, **details: Any) -> dict:
    return {"seq": seq, "time": BASE_TIME + time_s, "event": event}  | ({"request": request} if request else {}) \
        | details
