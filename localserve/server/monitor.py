"""`/v1/monitor` and `/slots`: the engine's snapshots and events, shared by every reader.

`MonitorHub` asks the engine thread for at most one snapshot per interval, however many monitor
clients there are, and copies the engine's new events into a bounded buffer of its own. Each client
has a cursor into that buffer: it gets every event after its cursor exactly once, in order, and a
`missed_events` count when it fell further behind than the buffer holds. A client that reads slower
than its interval gets fewer snapshots (always the latest), never a growing queue. Each snapshot frame
also carries the server's own figures on its connections (`connections`), which the engine never sees.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from localserve.engine.events import EngineEvent
from localserve.engine.facts import EngineFacts
from localserve.engine.snapshot import EngineSnapshot
from localserve.server.connection_phases import ConnectionCounts
from localserve.server.context import close_within

MIN_MONITOR_INTERVAL_S = 0.05
SEND_TIMEOUT_S = 30.0  # a monitor client that takes no frame for this long is disconnected
EVENT_BUFFER_SIZE = 10_000  # events kept for monitor clients that fall behind; the oldest go first


def slots_json(snapshot: EngineSnapshot, hello: dict[str, Any]) -> dict[str, Any]:
    """What `/slots` returns: the requests (by label) and the pool's counts; `hello` is `monitor_hello`'s."""
    gauges = snapshot.stats.gauges
    requests = [{key: value for key, value in asdict(r).items() if key != "block_tables"}
                for r in snapshot.requests]
    return {"max_num_seqs": hello["max_num_seqs"], "requests": requests,
            "blocks": {"num_blocks": hello["num_blocks"], "block_size": hello["block_size"],
                       "num_free_blocks": gauges.num_free_blocks,
                       "num_cached_blocks": gauges.num_cached_blocks, "num_used_blocks": gauges.num_used_blocks,
                       "usage_ratio": gauges.kv_cache_usage_ratio,
                       "num_cpu_blocks": hello["num_cpu_blocks"], "num_free_cpu_blocks": gauges.num_free_cpu_blocks}}


def monitor_hello(facts: EngineFacts, model_name: str) -> dict[str, Any]:
    """What does not change while the server runs: the pool's shape and what each KV format would hold."""
    return {"model": model_name, "block_size": facts.block_size, "num_blocks": facts.num_gpu_blocks,
            "num_cpu_blocks": facts.num_cpu_blocks, "max_num_seqs": facts.max_num_seqs,
            "max_num_batched_tokens": facts.max_num_batched_tokens, "max_model_len": facts.max_model_len,
            "cache_type_k": facts.cache_type_k, "cache_type_v": facts.cache_type_v,
            "kv_cache_bytes": facts.kv_cache_bytes, "capacity": [asdict(row) for row in facts.capacity]}


class MonitorHub:
    """One snapshot per interval for all monitor clients, and the engine's events since the last one."""

    def __init__(self, read: Callable[[int], Awaitable[tuple[EngineSnapshot, list[EngineEvent], int]]],
                 start_seq: int = 0, buffer_size: int = EVENT_BUFFER_SIZE) -> None:
        # read(after_seq) runs on the engine thread: (snapshot, events after after_seq, events missed)
        self._read = read
        self._snapshot: EngineSnapshot | None = None
        self._taken_at = float("-inf")
        self._events: deque[EngineEvent] = deque(maxlen=buffer_size)
        self._last_seq = start_seq  # events up to this one happened before the hub existed
        self._lock = asyncio.Lock()

    @property
    def last_seq(self) -> int:
        return self._last_seq

    async def latest(self, max_age_s: float) -> EngineSnapshot:
        """A snapshot no older than `max_age_s`, refreshed (with new events) only when needed."""
        async with self._lock:
            if time.monotonic() - self._taken_at >= max_age_s or self._snapshot is None:
                snapshot, events, _ = await self._read(self._last_seq)
                self._events.extend(events)
                if events:
                    self._last_seq = events[-1].seq
                self._snapshot, self._taken_at = snapshot, time.monotonic()
            return self._snapshot

    def events_after(self, after_seq: int) -> tuple[list[dict[str, Any]], int]:
        """Events numbered above `after_seq` still buffered (as JSON), and how many of them are gone."""
        events = [event.to_json() for event in self._events if event.seq > after_seq]
        # Sequence numbers are consecutive, so whatever is neither buffered nor already seen was missed:
        # dropped from this buffer, or from the engine's log before the hub read it.
        return events, max(0, self._last_seq - after_seq) - len(events)


async def serve_monitor(connection: ServerConnection, hub: MonitorHub, hello: dict[str, Any],
                        interval_s: float, connection_counts: Callable[[], ConnectionCounts]) -> None:
    """Send `hello`, then a snapshot with the new events (and the server's `connection_counts` at that
    moment) every interval, until the client leaves."""
    cursor = hub.last_seq  # events from the moment the client connected on
    await connection.send(json.dumps({"type": "monitor.hello", **hello}))
    closed = asyncio.create_task(connection.wait_closed())
    try:
        loop = asyncio.get_running_loop()
        while not closed.done():
            cycle_started = loop.time()
            snapshot = await hub.latest(interval_s)
            events, missed = hub.events_after(cursor)
            if events:
                cursor = events[-1]["seq"]
            frame = {"type": "monitor.snapshot", **snapshot.to_json(), "events": events, "missed_events": missed,
                     "connections": connection_counts().to_json()}
            send = asyncio.create_task(connection.send(json.dumps(frame)))
            # A client that does not read blocks only its own send, and only for so long.
            await asyncio.wait([send, closed], timeout=SEND_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            if not send.done():
                send.cancel()
                await close_within(connection, 1008, "the monitor client stopped reading")
                break
            send.result()
            # The interval is from one frame to the next: reading the snapshot waits for the engine's
            # step to end, and sleeping a whole interval on top would send fewer frames than asked for.
            await asyncio.wait([closed], timeout=max(0.0, interval_s - (loop.time() - cycle_started)))
    except ConnectionClosed:
        pass
    finally:
        closed.cancel()
