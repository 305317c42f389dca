"""The connection figures of /metrics (server/monitor/metrics.py's `watch_connections`), read from a connection book
at scrape time and parsed with `prometheus_client`'s own parser: open and served connections, unfinished
ones by phase, and those closed unfinished by phase and reason, under the `localserve_` prefix with the
`model_name` label and no other label than `phase` and `reason` (a handful of values each)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from localserve.engine.snapshot import Counters, EngineStats, Gauges
from localserve.server.monitor.metrics import ServerMetrics
from localserve.server.wire.connection_phases import CloseReason, ConnectionBook, Phase

STATS = EngineStats(Gauges(0, 0, 0, 0.0, 64, 0, 0, 0, 0.0, 0), Counters(*[0] * 13))


def test_the_connection_figures_are_the_books_at_scrape_time():
    book = ConnectionBook(max_connections=4, max_unfinished_connections=3)
    slots = [book.connection_opened(lambda: None) for _ in range(4)]
    for slot in slots:
        slot.evictable = True
    book.enter(slots[0], Phase.REQUEST)
    book.enter(slots[1], Phase.BODY)
    book.enter(slots[2], Phase.HANDSHAKE)
    book.enter(slots[3], Phase.FIRST_EVENT)
    book.cut(slots[3], CloseReason.TIMEOUT)  # silent too long
    book.connection_opened(lambda: None).evictable = True
    book.connection_opened(lambda: None)  # the cap (3): the oldest unfinished (the body) is evicted
    # open: 6 (the timed-out and the evicted one are still closing); served 1; heads 2, a handshake 1
    metrics = ServerMetrics("tiny")
    metrics.watch_connections(book.counts)
    families = {family.name: family for family in text_string_to_metric_families(metrics.render(STATS).decode())}
    found = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
             for name in ("localserve_num_connections", "localserve_num_served_connections",
                          "localserve_num_unfinished_connections", "localserve_unfinished_connections_closed")
             for sample in families[name].samples}
    assert families["localserve_unfinished_connections_closed"].type == "counter"
    assert found[("localserve_num_connections", (("model_name", "tiny"),))] == 6
    assert found[("localserve_num_served_connections", (("model_name", "tiny"),))] == 1
    unfinished = {dict(labels)["phase"]: value for (name, labels), value in found.items()
                  if name == "localserve_num_unfinished_connections"}
    assert unfinished == {"headers": 2, "body": 0, "handshake": 1, "first_event": 0}
    closed = {(dict(labels)["phase"], dict(labels)["reason"]): value for (name, labels), value in found.items()
              if name == "localserve_unfinished_connections_closed_total"}
    assert closed == {(phase.value, reason.value): 0 for phase in (Phase.HEADERS, Phase.BODY, Phase.HANDSHAKE,
                                                                   Phase.FIRST_EVENT) for reason in CloseReason
                      } | {("first_event", "timeout"): 1, ("body", "evicted"): 1}
    assert {key for (_, labels) in found for key, _ in labels} <= {"model_name", "phase", "reason"}
    book.enter(book.connection_opened(lambda: None), Phase.REQUEST)  # read at every scrape: one more served
    again = {sample.name: sample.value for sample in next(
        family for family in text_string_to_metric_families(metrics.render(STATS).decode())
        if family.name == "localserve_num_served_connections").samples}
    assert again == {"localserve_num_served_connections": 2}
