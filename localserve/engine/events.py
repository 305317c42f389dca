"""The engine's event log: what happened to which request, appended as it happens (no torch here).

Every event gets the next sequence number. The log keeps the most recent `capacity` events; a reader
remembers the last number it saw and asks for everything after it, and is told how many it missed if
the log moved past them in the meantime. The monitor, the TUI and tests read this; nothing compares
snapshots to guess what happened.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class EventKind(str, enum.Enum):
    ADMITTED = "admitted"  # num_prompt_tokens
    PREFIX_HIT = "prefix_hit"  # num_cached_tokens
    PREFILL_CHUNK = "prefill_chunk"  # num_tokens, num_computed_tokens (before this chunk)
    FIRST_TOKEN = "first_token"
    PREEMPTED = "preempted"  # mode: recompute | swap; fallback: swap was asked for, the swap pool was full
    SWAPPED_OUT = "swapped_out"  # num_blocks
    SWAPPED_IN = "swapped_in"  # num_blocks
    RESUMED = "resumed"  # readmitted after a preemption
    COPY_ON_WRITE = "copy_on_write"  # num_blocks
    FINISHED = "finished"  # reason: stop | length | abort
    FAILED = "failed"  # reason
    REJECTED = "rejected"  # reason (never admitted: it could never run)


@dataclass(frozen=True)
class EngineEvent:
    seq: int  # consecutive over the engine's life
    time: float  # wall clock (time.time())
    kind: EventKind
    request: str  # the request's label (not its id)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.time, "event": self.kind.value, "request": self.request,
                **self.details}


class EventLog:
    """A bounded, thread-safe log of engine events with consecutive sequence numbers."""

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque[EngineEvent] = deque(maxlen=capacity)
        self._next_seq = 1
        self._lock = threading.Lock()  # appended on the engine thread, read from others

    @property
    def last_seq(self) -> int:
        """The number of the newest event (0 before the first)."""
        return self._next_seq - 1

    def append(self, kind: EventKind, request: str, **details: Any) -> EngineEvent:
        with self._lock:
            event = EngineEvent(self._next_seq, time.time(), kind, request, details)
            self._next_seq += 1
            self._events.append(event)
        return event

    def since(self, after_seq: int) -> tuple[list[EngineEvent], int]:
        """Events numbered above `after_seq`, oldest first, and how many of those the log no longer holds."""
        with self._lock:
            if not self._events or after_seq >= self._events[-1].seq:
                return [], 0
            first = self._events[0].seq
            missed = max(0, first - after_seq - 1)
            skip = max(0, after_seq + 1 - first)
            return [self._events[i] for i in range(skip, len(self._events))], missed
