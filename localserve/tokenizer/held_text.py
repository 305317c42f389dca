"""Finding markers in text that arrives in pieces, holding back only what may still become one.

A stream parser must never let a marker (a trigger such as `<tool_call>`, or `</think>`) leak into the text it
passes on, yet must not delay text that cannot be part of one. `split_at_marker` says how much of a buffer is
safe to pass on now: everything before a complete marker, or, when there is none, everything before the
longest tail that is the start of a marker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MarkerSplit", "is_prefix_of_any", "split_at_marker"]


@dataclass(frozen=True, slots=True)
class MarkerSplit:
    """`text[:safe_end]` holds no marker and cannot be the start of one.

    `marker` is the first complete marker found (it starts at `safe_end`), or None; then `text[safe_end:]`
    is the held-back tail that may still grow into a marker.
    """

    safe_end: int
    marker: str | None


def split_at_marker(text: str, markers: Sequence[str]) -> MarkerSplit:
    """Where the first of `markers` starts in `text` (the earliest; the longest of those starting together),
    or, when none is complete, where the longest tail of `text` that starts some marker begins."""
    first: tuple[int, int, str] | None = None  # (start, -length, marker)
    for marker in markers:
        start = text.find(marker)
        if start >= 0 and (first is None or (start, -len(marker)) < first[:2]):
            first = (start, -len(marker), marker)
    if first is not None:
        return MarkerSplit(first[0], first[2])
    longest = max((len(marker) for marker in markers), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        if is_prefix_of_any(text[start:], markers):
            return MarkerSplit(start, None)
    return MarkerSplit(len(text), None)


def is_prefix_of_any(text: str, markers: Sequence[str]) -> bool:
    """True when `text` is the beginning of one of `markers` (a marker itself counts)."""
    return any(marker.startswith(text) for marker in markers)
