"""Every open connection and the phase it is in: two limits, so unfinished requests cannot lock out finished ones.

A connection is **unfinished** while it has not yet sent a whole request: an HTTP request head or body
still arriving (`headers`, `body`), a websocket upgrade being answered (`handshake`), a `/v1/responses`
websocket that has not sent its first event (`first_event`). It is **served** once it has: an HTTP request
being answered (`request`) or a keep-alive connection between two requests (`idle`), a websocket that has
spoken or a monitor (`websocket`). The two are capped apart:

- at most `max_connections` served connections: a whole request beyond them is refused (429
  `too_many_connections`), its connection still unfinished;
- at most `max_unfinished_connections` unfinished ones: one more never waits nor is refused, the oldest
  unfinished connection (the one unfinished longest) is closed to make room (`evicted`).

So a flood of connections that never finish a request costs well-formed clients nothing but the moment
their own request takes to arrive. An evicted connection is closed after `evicted_linger_s` (or at its
phase's bound, if sooner), so that a flood that reconnects as soon as it is closed comes back at that
pace; a connection is never evicted before it has been read once (a request may be waiting in its
socket), nor during its handshake (its whole upgrade is in: the server owes it the answer).

Each phase is also bounded in time (`PhaseBounds`), by whoever owns the connection in that phase
(server/wire/transport.py for HTTP and the handshake, server/openai/responses_socket.py for the first
event); a connection cut by its bound is counted as closed for its phase (`timeout`). The book keeps no
clock and no socket: the owners tell it what happens, it keeps the counts and picks the connection to evict.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from localserve.server.request.validation import ProtocolError


class Phase(str, Enum):
    """Where a connection is in its request (the values are the `phase` labels of /metrics and the monitor)."""

    HEADERS = "headers"  # an HTTP request head (or websocket upgrade) has not arrived whole
    BODY = "body"  # its head has, its body has not
    HANDSHAKE = "handshake"  # a websocket upgrade head arrived: the server's checks and its 101
    FIRST_EVENT = "first_event"  # an open /v1/responses websocket that has sent nothing yet
    REQUEST = "request"  # a whole HTTP request, being answered
    IDLE = "idle"  # a keep-alive HTTP connection between a response and the next request's first byte
    WEBSOCKET = "websocket"  # a websocket that has sent an event, or a monitor
    CLOSING = "closing"  # cut or refused: counted as open until its socket is gone, and in no limit


UNFINISHED_PHASES = (Phase.HEADERS, Phase.BODY, Phase.HANDSHAKE, Phase.FIRST_EVENT)
SERVED_PHASES = (Phase.REQUEST, Phase.IDLE, Phase.WEBSOCKET)


class CloseReason(str, Enum):
    """Why an unfinished connection was closed (the `reason` label)."""

    TIMEOUT = "timeout"  # its phase's bound passed
    EVICTED = "evicted"  # it was the oldest unfinished connection when one more came


@dataclass(frozen=True)
class PhaseBounds:
    """How long a connection may take over each phase, and the slowest body accepted."""

    header_s: float = 10.0  # from the connection (or the first byte after a response) to the end of the head
    body_gap_s: float = 10.0  # the longest wait for the next bytes of a body; also the grace of min_body_rate
    min_body_rate: float = 16384.0  # bytes/s a body must average once it has taken body_gap_s (0: no minimum)
    keep_alive_s: float = 5.0  # idle between a response and the first byte of the next request
    handshake_s: float = 10.0  # from a websocket upgrade's head to its 101
    first_event_s: float = 60.0  # from a /v1/responses websocket's 101 to its first event
    # An evicted connection is closed this long after its eviction (out of every limit meanwhile, its bytes
    # unread), or at its phase's bound if that comes first: a client that reconnects as soon as it is closed
    # comes back no faster, so a flood over the cap cannot turn into a storm of evictions.
    evicted_linger_s: float = 1.0

    def body_deadline(self, started: float, last_bytes_at: float, num_bytes: int) -> float:
        """When a body begun at `started`, whose latest bytes came at `last_bytes_at`, `num_bytes` in all so
        far, has been too slow: no bytes for body_gap_s, or below min_body_rate once past the first body_gap_s."""
        gap_deadline = last_bytes_at + self.body_gap_s
        if self.min_body_rate <= 0:
            return gap_deadline
        return min(gap_deadline, started + self.body_gap_s + num_bytes / self.min_body_rate)


class Slot:
    """One open connection as the book knows it: its phase, and what to do when it is evicted (set by
    whoever owns the connection in that phase: the HTTP protocol, the websocket handshake, the session)."""

    __slots__ = ("phase", "on_evicted", "evictable")

    def __init__(self, on_evicted: Callable[[], None]) -> None:
        self.phase = Phase.HEADERS
        self.on_evicted = on_evicted
        # Set by its owner once the connection has had a chance to send (its socket has been read once):
        # a client whose request already waits in the socket is never evicted before it is read.
        self.evictable = False


# websocket close reasons (at most 123 bytes), with 1013: evicted before its first event; beyond max_connections
EVICTED_REASON = "too many connections have sent no request yet: the oldest is closed"
LIMIT_REACHED_REASON = "the server holds its limit of connections"


def connection_limit_message(max_connections: int) -> str:
    """The refusal of a whole request beyond `max_connections` (429 `too_many_connections`), naming the limit."""
    return (f"the server holds its limit of {max_connections} connections with a request in progress "
            "(--max-connections); connections still sending theirs do not count; retry later")


@dataclass(frozen=True)
class ConnectionCounts:
    """The book's figures at one moment (what /metrics and the monitor show)."""

    num_open: int
    num_served: int
    unfinished: dict[Phase, int]  # open connections in each unfinished phase
    closed: dict[tuple[Phase, CloseReason], int]  # unfinished connections closed, by phase and reason, ever

    def to_json(self) -> dict[str, Any]:
        """The monitor snapshot's `connections` object (docs/PROTOCOL.md, "/v1/monitor")."""
        return {"num_open": self.num_open, "num_served": self.num_served,
                "num_unfinished": {phase.value: count for phase, count in self.unfinished.items()},
                "num_closed_unfinished": {phase.value: {reason.value: self.closed[phase, reason]
                                                        for reason in CloseReason}
                                          for phase in UNFINISHED_PHASES}}


class ConnectionBook:
    """The phase of every open connection, the two limits, the counts of unfinished connections closed."""

    def __init__(self, max_connections: int, max_unfinished_connections: int) -> None:
        if max_connections < 1 or max_unfinished_connections < 1:
            raise ValueError("max_connections and max_unfinished_connections must be at least 1")
        self.max_connections = max_connections
        self.max_unfinished_connections = max_unfinished_connections
        self.num_open = 0
        self.num_served = 0
        # Insertion order is the order connections became unfinished: the first is the oldest.
        self._unfinished: dict[Slot, None] = {}
        self._closed = {(phase, reason): 0 for phase in UNFINISHED_PHASES for reason in CloseReason}

    @property
    def served_full(self) -> bool:
        """True when a whole request now would be refused."""
        return self.num_served >= self.max_connections

    @property
    def limit_message(self) -> str:
        return connection_limit_message(self.max_connections)

    @property
    def eviction_message(self) -> str:
        """What an evicted connection is told."""
        return (f"{self.max_unfinished_connections} connections were still sending their requests, the most "
                "kept (--max-unfinished-connections): the oldest, this one, was closed")

    def connection_opened(self, on_evicted: Callable[[], None]) -> Slot:
        """A new connection, in its `headers` phase (the oldest unfinished one is evicted if there is no room)."""
        slot = Slot(on_evicted)
        self.num_open += 1
        self._make_room()
        self._unfinished[slot] = None
        return slot

    def enter(self, slot: Slot, phase: Phase) -> bool:
        """Move `slot` to `phase`. Entering a served phase from an unfinished one takes a place among
        max_connections: False when there is none (the request is refused; the slot stays where it was,
        as unfinished as before). Entering an unfinished phase from a served one may evict the oldest
        unfinished connection. Nothing leaves `closing`."""
        if slot.phase is Phase.CLOSING:
            return phase is Phase.CLOSING
        was_served, was_unfinished = slot.phase in SERVED_PHASES, slot in self._unfinished
        if phase in SERVED_PHASES and not was_served:
            if self.served_full:
                return False
            self._leave(slot)
            self.num_served += 1
        elif phase in UNFINISHED_PHASES and not was_unfinished:
            self._leave(slot)
            self._make_room()
            self._unfinished[slot] = None
        elif phase is Phase.CLOSING:
            self._leave(slot)
        slot.phase = phase
        return True

    def cut(self, slot: Slot, reason: CloseReason) -> None:
        """An unfinished connection is being closed for `reason`: counted for its phase, then `closing`."""
        if slot.phase in UNFINISHED_PHASES:
            self._closed[slot.phase, reason] += 1
        self.enter(slot, Phase.CLOSING)

    def close(self, slot: Slot) -> None:
        """The connection is gone."""
        self._leave(slot)
        slot.phase = Phase.CLOSING
        self.num_open -= 1

    def counts(self) -> ConnectionCounts:
        unfinished = dict.fromkeys(UNFINISHED_PHASES, 0)
        for slot in self._unfinished:
            unfinished[slot.phase] += 1
        return ConnectionCounts(self.num_open, self.num_served, unfinished, dict(self._closed))

    def _leave(self, slot: Slot) -> None:
        """Take `slot` out of whichever limit counts it."""
        if slot.phase in SERVED_PHASES:
            self.num_served -= 1
        self._unfinished.pop(slot, None)

    def _make_room(self) -> None:
        """Before one more unfinished connection: evict the oldest while the cap is reached. Connections too
        new to have been read are passed over; when every one is, the cap is exceeded for that moment."""
        while len(self._unfinished) >= self.max_unfinished_connections:
            oldest = next((slot for slot in self._unfinished if slot.evictable), None)
            if oldest is None:
                return
            self.cut(oldest, CloseReason.EVICTED)
            oldest.on_evicted()


class FirstEventWait:
    """A /v1/responses websocket waiting for its first event, as its session sees it: unfinished (it can be
    evicted: `evicted` is set) until the event comes, then served (or refused when there is no room)."""

    def __init__(self, book: ConnectionBook, slot: Slot) -> None:
        self._book, self._slot = book, slot
        self.evicted = asyncio.Event()
        slot.on_evicted = self.evicted.set
        slot.evictable = True  # its handshake is over: it may be evicted again
        book.enter(slot, Phase.FIRST_EVENT)

    def arrived(self) -> None:
        """The first event came: the connection is served from now on; a ProtocolError (429
        `too_many_connections`) when the server holds its limit of served connections."""
        if not self._book.enter(self._slot, Phase.WEBSOCKET):
            raise ProtocolError("too_many_connections", self._book.limit_message, error_type="rate_limit_error",
                                status=429)

    def timed_out(self) -> None:
        """Nothing came within the bound: counted, and the session closes the connection."""
        self._book.cut(self._slot, CloseReason.TIMEOUT)
