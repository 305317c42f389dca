"""Speculative decoding and the time budget in the monitor feed and the slots table: the fields parsed when
a server sends them, their defaults when an older server does not, the slots table's "spec" column."""

from __future__ import annotations

import pytest
from localserve.tui.feed import FeedError, parse_hello, parse_snapshot
from localserve.tui.slots import HEADERS, SPEC_HEADER, row_cells, spec_label

from tests.helpers.monitor_frames import hello_frame, request_entry, snapshot_frame


def frame_with_spec():
    requests = [request_entry("r1", "decode", [[0, 1]], spec_acceptance_rate=0.72, spec_mean_accepted_length=3.14),
                request_entry("r2", "decode", [[2]])]
    counters = {"spec_num_drafts": 10, "spec_num_draft_tokens": 40, "spec_num_accepted_tokens": 21}
    return snapshot_frame("uuu" + "." * 61, requests=requests, counters=counters, spec_acceptance_rate=0.525,
                          spec_mean_accepted_length=3.1, step_limit_s=0.12)


def test_the_speculation_and_budget_fields_are_parsed():
    snapshot = parse_snapshot(frame_with_spec(), parse_hello(hello_frame()))
    first, second = snapshot.requests
    assert (first.spec_acceptance_rate, first.spec_mean_accepted_length) == (0.72, 3.14)
    assert (second.spec_acceptance_rate, second.spec_mean_accepted_length) == (0.0, 0.0)  # left out: none yet
    assert snapshot.counters.spec_num_accepted_tokens == 21 and snapshot.counters.spec_num_drafts == 10
    assert snapshot.gauges.spec_mean_accepted_length == 3.1 and snapshot.gauges.step_limit_s == 0.12


def test_a_frame_without_them_parses_to_zeros_and_a_wrong_type_is_named():
    snapshot = parse_snapshot(snapshot_frame("." * 64), parse_hello(hello_frame()))
    assert snapshot.gauges.spec_acceptance_rate == 0.0 and snapshot.counters.spec_num_draft_tokens == 0
    frame = frame_with_spec()
    frame["requests"][0]["spec_acceptance_rate"] = "high"
    with pytest.raises(FeedError, match=r"requests\[0\].spec_acceptance_rate"):
        parse_snapshot(frame, parse_hello(hello_frame()))


def test_the_slots_table_shows_acceptance_and_tokens_per_verification():
    first, second = parse_snapshot(frame_with_spec(), parse_hello(hello_frame())).requests
    assert spec_label(first) == "72% ×3.1" and spec_label(second) == "-"
    assert len(row_cells(first)) == len(HEADERS) and row_cells(first, with_spec=True)[-1] == "72% ×3.1"
    assert SPEC_HEADER == "spec"


def test_the_spec_column_is_shown_only_while_a_request_has_verified_a_draft():
    from localserve.tui.slots import SlotsTable

    with_spec = parse_snapshot(frame_with_spec(), parse_hello(hello_frame())).requests
    table = SlotsTable()
    table.show(with_spec)
    assert table.headers == HEADERS + (SPEC_HEADER,) and table.rows[0][-1] == "72% ×3.1"
    table.show(with_spec[1:])
    assert table.headers == HEADERS and len(table.rows[0]) == len(HEADERS)
