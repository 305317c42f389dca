"""A request's grammar and reasoning in the monitor feed and the slots table (docs/PROTOCOL.md)."""

from __future__ import annotations

import pytest
from localserve.tui.feed import FeedError, parse_hello, parse_snapshot
from localserve.tui.slots import row_cells

from tests.helpers.monitor_frames import hello_frame, request_entry, snapshot_frame


def parsed(state: str = "decode", **fields):
    frame = snapshot_frame("u" + "." * 63, requests=[request_entry("r1", state, [[0]], **fields)])
    return parse_snapshot(frame, parse_hello(hello_frame(64))).requests[0]


def test_the_marks_are_read_and_shown_in_the_state_cell():
    request = parsed(constrained=True, num_reasoning_seqs=2)
    assert request.constrained and request.num_reasoning_seqs == 2
    assert row_cells(request)[1] == "decode [thinking, grammar]"
    assert row_cells(parsed(constrained=True))[1] == "decode [grammar]"
    assert row_cells(parsed(num_reasoning_seqs=1, state="prefill", num_computed_prompt_tokens=10))[1] == \
        "prefill 25% 10/40 [thinking]"


def test_a_server_without_the_fields_shows_no_marks():
    request = parsed()
    assert not request.constrained and request.num_reasoning_seqs == 0 and row_cells(request)[1] == "decode"


@pytest.mark.parametrize("fields, message", [
    ({"constrained": 1}, r"requests\[0\].constrained must be bool, got int"),
    ({"num_reasoning_seqs": True}, r"requests\[0\].num_reasoning_seqs must be int, got bool"),
    ({"num_reasoning_seqs": -1}, r"requests\[0\].num_reasoning_seqs must be >= 0, got -1"),
])
def test_bad_marks_name_the_field(fields, message):
    with pytest.raises(FeedError, match=message):
        parsed(**fields)
