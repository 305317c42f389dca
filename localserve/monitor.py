"""What `/slots` and `/v1/monitor` show: the requests in the engine, every block's state, counters.

`read_slots` and `read_monitor_snapshot` run on the engine thread (through `EngineThread.call`).
`MonitorEvents` turns two successive snapshots into events (admitted, resumed, preempted, prefix hit,
copy-on-write, finished); they are sampled at the monitor's rate, so a request that comes and goes
between two snapshots shows no events. `serve_monitor` streams snapshots to one client, keeping only
the latest unsent one, so a slow client gets fewer snapshots and never a growing queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from localserve.metrics import EngineStats

MIN_MONITOR_INTERVAL_S = 0.05
MAX_PENDING_EVENTS = 1000  # events kept for a client that does not read; the oldest go first


def read_slots(engine) -> dict[str, Any]:
    """Requests in the engine and the state of the block pool (call on the engine thread)."""
    scheduler, block_manager = engine.scheduler, engine.block_manager
    requests = []
    for state, queue in (("running", scheduler.running), ("waiting", scheduler.waiting),
                         ("swapped", scheduler.swapped)):
        for request in queue:
            num_output_tokens = max((len(seq.output_token_ids) for seq in request.seqs), default=0)
            requests.append({"id": request.request_id, "state": state,
                             "num_prompt_tokens": len(request.prompt_token_ids),
                             "num_output_tokens": num_output_tokens,
                             "num_cached_tokens": request.num_cached_tokens,
                             "num_seqs": len(request.live_seqs), "num_preemptions": request.num_preemptions})
    return {"max_num_seqs": scheduler.config.max_num_seqs, "requests": requests,
            "blocks": {"num_blocks": block_manager.num_blocks, "block_size": block_manager.block_size,
                       "num_free_blocks": block_manager.num_free_blocks,
                       "num_cached_blocks": block_manager.num_cached_blocks,
                       "num_used_blocks": block_manager.num_used_blocks,
                       "usage_ratio": block_manager.usage_ratio,
                       "num_cpu_blocks": block_manager.num_cpu_blocks,
                       "num_free_cpu_blocks": block_manager.num_free_cpu_blocks}}


def read_monitor_snapshot(engine) -> dict[str, Any]:
    """Every block's state, the slots and the counters (call on the engine thread)."""
    pool = engine.block_manager.snapshot()
    last_step = engine.step_history[-1] if engine.step_history else None
    counters = dataclasses.asdict(EngineStats.read(engine)) | {
        "cow_copies": engine.block_manager.cow_copies,
        "cached_block_evictions": engine.block_manager.cached_block_evictions,
        "num_steps": len(engine.step_history)}
    return {"type": "monitor.snapshot", "time": time.time(), "slots": read_slots(engine),
            "block_states": pool.block_states, "cpu_block_states": pool.cpu_block_states,
            "counters": counters,
            "last_step": dataclasses.asdict(last_step) if last_step else None}


class MonitorEvents:
    """Events found by comparing each snapshot with the one before."""

    def __init__(self) -> None:
        self._requests: dict[str, dict[str, Any]] = {}
        self._cow_copies: int | None = None

    def diff(self, snapshot: dict[str, Any]) -> list[dict[str, Any]]:
        """The events between the previous snapshot and this one."""
        events: list[dict[str, Any]] = []
        now = {request["id"]: request for request in snapshot["slots"]["requests"]}
        for request_id, request in now.items():
            before = self._requests.get(request_id)
            if before is not None and request["num_preemptions"] > before["num_preemptions"]:
                events.append({"event": "preempted", "id": request_id, "state": request["state"]})
            if request["state"] == "running" and (before is None or before["state"] != "running"):
                resumed = request["num_preemptions"] > 0
                events.append({"event": "resumed" if resumed else "admitted", "id": request_id})
                if request["num_cached_tokens"] and not resumed:
                    events.append({"event": "prefix_hit", "id": request_id,
                                   "num_cached_tokens": request["num_cached_tokens"]})
        events += [{"event": "finished", "id": request_id}
                   for request_id in self._requests if request_id not in now]
        cow_copies = snapshot["counters"]["cow_copies"]
        if self._cow_copies is not None and cow_copies > self._cow_copies:
            events.append({"event": "copy_on_write", "num_blocks": cow_copies - self._cow_copies})
        self._requests, self._cow_copies = now, cow_copies
        return events


async def serve_monitor(connection: ServerConnection, read_snapshot: Callable[[], Awaitable[dict[str, Any]]],
                        interval_s: float) -> None:
    """Send a snapshot (with the events since the last one sent) every interval until the client leaves."""
    tracker = MonitorEvents()
    pending_events: deque[dict[str, Any]] = deque(maxlen=MAX_PENDING_EVENTS)
    latest: dict[str, Any] = {}
    ready = asyncio.Event()

    async def send_latest() -> None:
        while True:
            await ready.wait()
            ready.clear()
            message = latest["snapshot"] | {"events": list(pending_events)}
            pending_events.clear()
            await connection.send(json.dumps(message))

    sender = asyncio.create_task(send_latest())
    closed = asyncio.create_task(connection.wait_closed())
    try:
        while not closed.done() and not sender.done():
            snapshot = await read_snapshot()
            pending_events.extend(tracker.diff(snapshot))
            latest["snapshot"] = snapshot  # replaces one the client has not taken yet
            ready.set()
            await asyncio.wait([closed, sender], timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sender, closed):
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, ConnectionClosed):
                pass
