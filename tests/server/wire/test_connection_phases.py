"""The connection book (server/wire/connection_phases.py) on its own: served and unfinished connections capped
apart, the oldest unfinished evicted first, a whole request beyond the served limit refused, the counts by
phase, the body's deadline; and, generated, that its counts always agree with the phases of its slots."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.server.request.validation import ProtocolError
from localserve.server.wire.connection_phases import (
    SERVED_PHASES,
    UNFINISHED_PHASES,
    CloseReason,
    ConnectionBook,
    FirstEventWait,
    Phase,
    PhaseBounds,
    Slot,
)


class Evictions:
    """Records which connections the book evicted, in order."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def opener(self, book: ConnectionBook):
        def open_named(name: str) -> Slot:
            return read_once(book.connection_opened(lambda: self.order.append(name)))
        return open_named


def read_once(slot: Slot) -> Slot:
    """What the transport does once a connection's socket has been read: it may be evicted from then on."""
    slot.evictable = True
    return slot


def test_a_new_connection_is_unfinished_and_a_whole_request_makes_it_served():
    book = ConnectionBook(max_connections=2, max_unfinished_connections=4)
    slot = book.connection_opened(lambda: None)
    assert slot.phase is Phase.HEADERS
    counts = book.counts()
    assert (counts.num_open, counts.num_served, counts.unfinished[Phase.HEADERS]) == (1, 0, 1)
    assert book.enter(slot, Phase.BODY) and book.counts().unfinished[Phase.BODY] == 1
    assert book.enter(slot, Phase.REQUEST)
    counts = book.counts()
    assert (counts.num_open, counts.num_served, sum(counts.unfinished.values())) == (1, 1, 0)
    book.close(slot)
    assert (book.num_open, book.num_served) == (0, 0)


def test_unfinished_connections_never_take_the_places_of_served_ones():
    book = ConnectionBook(max_connections=1, max_unfinished_connections=3)
    opened = Evictions().opener(book)
    unfinished = [opened(f"u{index}") for index in range(3)]
    served = opened("s")  # the fourth unfinished one: the oldest (u0) makes room
    assert book.enter(served, Phase.REQUEST)  # three unfinished ones are open; the one served place is free
    assert unfinished[0].phase is Phase.CLOSING
    assert [slot.phase for slot in unfinished[1:]] == [Phase.HEADERS, Phase.HEADERS]


def test_when_the_cap_is_reached_the_oldest_unfinished_connection_is_evicted_first():
    book = ConnectionBook(max_connections=8, max_unfinished_connections=3)
    evictions = Evictions()
    opened = evictions.opener(book)
    first, second, third = opened("first"), opened("second"), opened("third")
    book.enter(first, Phase.BODY)  # a later phase keeps its age: it became unfinished first
    book.enter(second, Phase.HANDSHAKE)
    opened("fourth")
    assert evictions.order == ["first"]
    opened("fifth")
    assert evictions.order == ["first", "second"]
    closed = book.counts().closed
    assert closed[Phase.BODY, CloseReason.EVICTED] == closed[Phase.HANDSHAKE, CloseReason.EVICTED] == 1
    assert (book.num_open, sum(book.counts().unfinished.values())) == (5, 3)  # evicted ones are open until gone
    assert third.phase is Phase.HEADERS


def test_a_served_connection_is_never_evicted_and_is_young_again_when_its_next_request_begins():
    book = ConnectionBook(max_connections=8, max_unfinished_connections=2)
    evictions = Evictions()
    opened = evictions.opener(book)
    keep_alive = opened("keep-alive")
    book.enter(keep_alive, Phase.REQUEST)
    book.enter(keep_alive, Phase.IDLE)
    opened("a"), opened("b")
    opened("c")
    assert evictions.order == ["a"]  # not the idle one, older though it is
    book.enter(keep_alive, Phase.HEADERS)  # its next head begins: the newest unfinished connection
    assert evictions.order == ["a", "b"]
    opened("d")
    assert evictions.order == ["a", "b", "c"]


def test_a_whole_request_beyond_max_connections_is_refused_and_its_connection_stays_unfinished():
    book = ConnectionBook(max_connections=2, max_unfinished_connections=8)
    slots = [book.connection_opened(lambda: None) for _ in range(3)]
    assert [book.enter(slot, Phase.REQUEST) for slot in slots] == [True, True, False]
    assert slots[2].phase is Phase.HEADERS and book.served_full
    assert book.counts().unfinished[Phase.HEADERS] == 1
    book.cut(slots[2], CloseReason.TIMEOUT)
    assert not book.enter(slots[2], Phase.REQUEST)  # nothing leaves `closing`
    assert "limit of 2 connections" in book.limit_message and "--max-connections" in book.limit_message
    book.close(slots[0])
    late = book.connection_opened(lambda: None)
    assert book.enter(late, Phase.WEBSOCKET)  # a place came back


def test_cut_counts_an_unfinished_connection_by_its_phase_and_reason_and_a_served_one_not_at_all():
    book = ConnectionBook(max_connections=2, max_unfinished_connections=8)
    slowpoke, served = book.connection_opened(lambda: None), book.connection_opened(lambda: None)
    book.enter(slowpoke, Phase.FIRST_EVENT)
    book.enter(served, Phase.WEBSOCKET)
    book.cut(slowpoke, CloseReason.TIMEOUT)
    book.cut(served, CloseReason.TIMEOUT)
    closed = book.counts().closed
    assert closed[Phase.FIRST_EVENT, CloseReason.TIMEOUT] == 1 and sum(closed.values()) == 1
    assert book.num_served == 0 and book.num_open == 2


def test_counts_in_json_name_every_unfinished_phase_and_reason():
    book = ConnectionBook(max_connections=2, max_unfinished_connections=1)
    read_once(book.connection_opened(lambda: None))
    book.connection_opened(lambda: None)  # evicts the first
    assert book.counts().to_json() == {
        "num_open": 2, "num_served": 0,
        "num_unfinished": {"headers": 1, "body": 0, "handshake": 0, "first_event": 0},
        "num_closed_unfinished": {"headers": {"timeout": 0, "evicted": 1}, "body": {"timeout": 0, "evicted": 0},
                                  "handshake": {"timeout": 0, "evicted": 0},
                                  "first_event": {"timeout": 0, "evicted": 0}}}


def test_a_connection_not_yet_read_is_never_evicted_and_the_cap_waits_for_it():
    book = ConnectionBook(max_connections=8, max_unfinished_connections=2)
    evictions = Evictions()
    opened = evictions.opener(book)
    unread = book.connection_opened(lambda: evictions.order.append("unread"))  # its request may be in its socket
    opened("a")
    opened("b")
    assert evictions.order == ["a"]  # the unread one is older, and passed over
    unread_too = book.connection_opened(lambda: evictions.order.append("unread too"))
    assert evictions.order == ["a", "b"]
    opened("c")  # only unread ones to evict: over the cap for a moment
    assert evictions.order == ["a", "b"] and sum(book.counts().unfinished.values()) == 3
    read_once(unread)
    opened("d")  # back within the cap, the oldest read ones first
    assert evictions.order == ["a", "b", "unread", "c"]
    assert unread_too.phase is Phase.HEADERS and sum(book.counts().unfinished.values()) == 2


def test_limits_below_one_are_refused():
    with pytest.raises(ValueError):
        ConnectionBook(max_connections=1, max_unfinished_connections=0)


def test_a_first_event_wait_is_evictable_then_served_or_refused():
    async def main():
        book = ConnectionBook(max_connections=1, max_unfinished_connections=2)
        waits = []
        for _ in range(2):
            slot = read_once(book.connection_opened(lambda: None))
            book.enter(slot, Phase.HANDSHAKE)
            waits.append((slot, FirstEventWait(book, slot)))
        (first, first_wait), (second, second_wait) = waits
        assert first.phase is second.phase is Phase.FIRST_EVENT
        book.connection_opened(lambda: None)  # a third unfinished connection: the oldest wait is told it is evicted
        assert first_wait.evicted.is_set() and not second_wait.evicted.is_set()
        second_wait.arrived()
        assert second.phase is Phase.WEBSOCKET
        third = book.connection_opened(lambda: None)
        book.enter(third, Phase.HANDSHAKE)
        third_wait = FirstEventWait(book, third)
        with pytest.raises(ProtocolError) as refused:
            third_wait.arrived()  # the one served place is taken
        assert (refused.value.code, refused.value.status) == ("too_many_connections", 429)
        fourth = book.connection_opened(lambda: None)
        FirstEventWait(book, fourth).timed_out()
        assert book.counts().closed[Phase.FIRST_EVENT, CloseReason.TIMEOUT] == 1

    asyncio.run(main())


@pytest.mark.parametrize("started, last, num_bytes, expected", [
    (0.0, 0.0, 0, 10.0),  # nothing yet: the gap (also the rate's grace)
    (0.0, 9.0, 100, 10.0 + 100 / 16384),  # bytes keep coming, too few: the rate line
    (0.0, 3.0, 1 << 20, 13.0),  # plenty: the next gap
])
def test_the_body_deadline_is_the_gap_or_the_minimum_rate_whichever_comes_first(started, last, num_bytes, expected):
    assert PhaseBounds().body_deadline(started, last, num_bytes) == pytest.approx(expected)


def test_a_minimum_body_rate_of_zero_leaves_only_the_gap():
    assert PhaseBounds(min_body_rate=0).body_deadline(0.0, 30.0, 5) == 40.0


OPERATIONS = st.lists(st.tuples(st.sampled_from(["open", "enter", "cut", "close"]), st.integers(0, 15),
                                st.sampled_from(list(Phase))), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPERATIONS, st.integers(1, 4), st.integers(1, 4))
def test_the_counts_always_agree_with_the_phases_and_stay_within_the_limits(operations, max_served, max_unfinished):
    book = ConnectionBook(max_connections=max_served, max_unfinished_connections=max_unfinished)
    evicted: list[Slot] = []
    open_slots: list[Slot] = []

    def opened() -> Slot:
        slot = read_once(book.connection_opened(lambda: evicted.append(slot)))
        return slot

    for operation, index, phase in operations:
        if operation == "open" or not open_slots:
            open_slots.append(opened())
            continue
        slot = open_slots[index % len(open_slots)]
        before = slot.phase
        if operation == "enter":
            book.enter(slot, phase)
            if before is Phase.CLOSING:
                assert slot.phase is Phase.CLOSING
        elif operation == "cut":
            book.cut(slot, CloseReason.TIMEOUT)
        else:
            book.close(slot)
            open_slots.remove(slot)
        counts = book.counts()
        assert counts.num_open == len(open_slots)
        assert counts.num_served == sum(s.phase in SERVED_PHASES for s in open_slots) <= max_served
        assert sum(counts.unfinished.values()) == sum(s.phase in UNFINISHED_PHASES for s in open_slots)
        assert sum(counts.unfinished.values()) <= max_unfinished
        assert all(s.phase is Phase.CLOSING for s in evicted)
