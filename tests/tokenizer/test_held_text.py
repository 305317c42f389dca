"""Markers found in text that arrives in pieces: what is safe to pass on now, what is held back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from localserve.tokenizer.held_text import MarkerSplit, is_prefix_of_any, split_at_marker

MARKERS = ["<tool_call>", "[TOOL_CALLS]"]


def test_a_complete_marker_is_found_and_the_text_before_it_is_safe():
    assert split_at_marker("ab <tool_call> x", MARKERS) == MarkerSplit(3, "<tool_call>")
    assert split_at_marker("x[TOOL_CALLS]<tool_call>", MARKERS) == MarkerSplit(1, "[TOOL_CALLS]")
    assert split_at_marker("<a>", ["<a>", "<a>b"]) == MarkerSplit(0, "<a>")
    assert split_at_marker("<a>b", ["<a>", "<a>b"]) == MarkerSplit(0, "<a>b")  # the longest at one place


def test_only_a_tail_that_starts_a_marker_is_held():
    assert split_at_marker("ab <tool_c", MARKERS) == MarkerSplit(3, None)
    assert split_at_marker("ab <tool_x", MARKERS) == MarkerSplit(10, None)
    assert split_at_marker("a<[TOOL", MARKERS) == MarkerSplit(2, None)
    assert split_at_marker("<", MARKERS) == MarkerSplit(0, None)
    assert split_at_marker("", MARKERS) == MarkerSplit(0, None)
    assert is_prefix_of_any("[TOOL", MARKERS) and not is_prefix_of_any("[TOOLS", MARKERS)


@given(st.text(alphabet="<tol_ca>[TOLCS]x", max_size=30))
def test_what_is_safe_never_holds_or_starts_a_marker(text):
    split = split_at_marker(text, MARKERS)
    safe, held = text[:split.safe_end], text[split.safe_end:]
    assert not any(marker in safe for marker in MARKERS)
    if split.marker is None:
        assert held == "" or is_prefix_of_any(held, MARKERS)
        assert not any(is_prefix_of_any(text[start:], MARKERS) for start in range(split.safe_end))
    else:
        assert held.startswith(split.marker)
