"""`/v1/monitor` and `/slots`: the engine's snapshots and events, shared by every reader.

`MonitorHub` asks the engine thread for at most one snapshot per interval, however many monitor
clients there are, and copies the engine's new events into a bounded buffer of its own. Each client
has a cursor into that buffer: it gets every event after its cursor exactly once, in order, and a
`missed_events` count when it fell further behind than the buffer holds. A client that reads slower
than its interval gets fewer snapshots (always the latest), never a growing queue. Each snapshot frame
also carries the server's own figures on its connections (`connections`), which the engine never sees.

Each loaded model has its engine, so its hub and its hello; a monitor follows the model its
`MonitorSource` serves now (server/registry/registry.py: the one loaded last): when that changes it sends the
new model's hello, then that engine's snapshots and events; while no model is loaded it sends
`monitor.no_model` frames. Every frame after the hello says which model is on its way (`loading`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from localserve.engine.events import EngineEvent
from localserve.engine.facts import EngineFacts
from localserve.engine.image_prompt import ImageEncoder, PreparedImage
from localserve.engine.snapshot import EngineSnapshot
from localserve.server.registry.engine_access import EngineAccess
from localserve.server.registry.served_model import ServedModel
from localserve.server.request.image_cache import BytesLRU
from localserve.server.wire.closing import close_within
from localserve.server.wire.connection_phases import ConnectionCounts

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
            "kv_cache_bytes": facts.kv_cache_bytes, "capacity": [asdict(row) for row in facts.capacity]} | (
        {"kv_groups": [asdict(group) for group in facts.kv_groups]} if facts.kv_groups else {})


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


@dataclass(frozen=True)
class ServingNow:
    """A loaded model as the monitor, `/slots` and `/metrics` read it."""

    model: ServedModel
    engine: EngineAccess
    monitor_hub: MonitorHub
    monitor_hello: dict[str, Any]
    vision: ImageEncoder | None = None  # the model's image encoder (models/vision/adapter.py), None: text only
    # what `vision` made of the pictures seen, by pixel hash (server/request/image_cache.py); dropped with the model
    prepared_images: BytesLRU[bytes, PreparedImage] | None = None


class MonitorSource(Protocol):
    """What a monitor follows (server/registry/registry.py's `ModelRegistry`)."""

    def serving_now(self) -> ServingNow | None:
        """The model to show now, or None when no model is loaded."""

    def loading_state(self) -> dict[str, Any] | None:
        """The model on its way (`model`, `phase`, `elapsed_s`), or None."""


async def serve_monitor(connection: ServerConnection, source: MonitorSource, interval_s: float,
                        connection_counts: Callable[[], ConnectionCounts]) -> None:
    """Send the hello of the model `source` serves now, then a snapshot with the new events (and the
    server's `connection_counts` at that moment) every interval, until the client leaves; a new model
    starts with its hello, no model is a `monitor.no_model` frame."""
    following = source.serving_now()
    cursor = following.monitor_hub.last_seq if following is not None else 0  # events from the connection on
    if following is not None:
        await connection.send(json.dumps({"type": "monitor.hello", **following.monitor_hello}))
    closed = asyncio.create_task(connection.wait_closed())
    try:
        loop = asyncio.get_running_loop()
        while not closed.done():
            cycle_started = loop.time()
            now = source.serving_now()
            if now is not None and now is not following:
                cursor = now.monitor_hub.last_seq  # the new engine's events from this moment on
                if not await _send(connection, {"type": "monitor.hello", **now.monitor_hello}, closed):
                    break
            following = now
            if now is None:
                frame = {"type": "monitor.no_model", "time": time.time(), "loading": source.loading_state()}
            else:
                try:
                    snapshot = await now.monitor_hub.latest(interval_s)
                except Exception:
                    if source.serving_now() is now:
                        raise
                    continue  # the model was unloaded while its snapshot was read: follow the next one
                events, missed = now.monitor_hub.events_after(cursor)
                if events:
                    cursor = events[-1]["seq"]
                frame = {"type": "monitor.snapshot", **snapshot.to_json(), "events": events,
                         "missed_events": missed, "connections": connection_counts().to_json(),
                         "loading": source.loading_state()}
            if not await _send(connection, frame, closed):
                break
            # The interval is from one frame to the next: reading the snapshot waits for the engine's
            # step to end, and sleeping a whole interval on top would send fewer frames than asked for.
            await asyncio.wait([closed], timeout=max(0.0, interval_s - (loop.time() - cycle_started)))
    except ConnectionClosed:
        pass
    finally:
        closed.cancel()


async def _send(connection: ServerConnection, frame: dict[str, Any], closed: asyncio.Task) -> bool:
    """Send one frame; False when the client left or took nothing for SEND_TIMEOUT_S (then it is closed)."""
    send = asyncio.create_task(connection.send(json.dumps(frame)))
    # A client that does not read blocks only its own send, and only for so long.
    await asyncio.wait([send, closed], timeout=SEND_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    if not send.done():
        send.cancel()
        await close_within(connection, 1008, "the monitor client stopped reading")
        return False
    send.result()
    return True
