"""Layer groups: the layers of a model grouped by how they keep KV, each group with its own block pool.

A group is "full" (every token's KV is kept while the sequence lives), "window W" (a query at position
p sees only the keys at positions p - W + 1 .. p, the last W keys, itself included: transformers'
sliding-window mask for Mistral, Qwen2, gpt-oss and Gemma 3 alike) or "state": recurrent layers
(linear attention) that keep no KV but a fixed-size state per sequence (kv/state_shape.py), whose pool
holds state slots, one per table entry that is not `NO_BLOCK` (kv/state_group.py). A window group frees
the blocks that fall wholly before the window of the sequence's next query, so its memory per sequence is
bounded by the window. No torch here: the engine derives each layer's kind from the model config and
hands the list in (a window, None for full attention, `RECURRENT` for a state layer).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


class _StateMarker(str, enum.Enum):
    """A str, so that the monitor's JSON carries it as "state" (docs/PROTOCOL.md)."""

    RECURRENT = "state"

    def __repr__(self) -> str:
        return "RECURRENT"


RECURRENT = _StateMarker.RECURRENT
"""What `BlockManager(group_windows=...)` and `group_layers` take for a recurrent (state) layer or group."""

GroupWindow = int | None | Literal[_StateMarker.RECURRENT]
"""A group's kind as the block manager takes it: a sliding window, None (full attention) or `RECURRENT`."""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One group: its window (None: full attention or state), the layers in it, in layer order, and
    whether they are recurrent (a state group)."""

    sliding_window: int | None
    layers: tuple[int, ...]
    recurrent: bool = False

    @property
    def label(self) -> str:
        return group_label(self.group_window)

    @property
    def group_window(self) -> GroupWindow:
        """What `BlockManager(group_windows=...)` takes for this group: its window, None or `RECURRENT`."""
        return RECURRENT if self.recurrent else self.sliding_window


def group_label(sliding_window: GroupWindow) -> str:
    """'full', 'window 128' or 'state', as the monitor and the plan name a group."""
    if sliding_window is RECURRENT:
        return "state"
    return "full" if sliding_window is None else f"window {sliding_window}"


def group_layers(layer_windows: Sequence[GroupWindow]) -> list[KVGroup]:
    """The groups of a model whose layer i has window `layer_windows[i]` (None: full attention,
    `RECURRENT`: a recurrent layer).

    Group 0 is the full-attention group where the model has a full layer; the window groups follow in
    increasing window order, the state group last. Raises ValueError on an empty model or a window below 1.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer to group")
    for layer, window in enumerate(layer_windows):
        if window is not None and window is not RECURRENT and window < 1:
            raise ValueError(f"layer {layer}: sliding window must be >= 1, got {window}")
    windows = sorted(set(layer_windows),
                     key=lambda window: (2, 0) if window is RECURRENT else (window is not None, window or 0))
    return [KVGroup(None if window is RECURRENT else window,
                    tuple(layer for layer, w in enumerate(layer_windows) if w == window), window is RECURRENT)
            for window in windows]


def window_start(num_computed_tokens: int, sliding_window: int | None) -> int:
    """First position the next query (at position `num_computed_tokens`) attends to in a window layer."""
    if sliding_window is None:
        return 0
    return max(0, num_computed_tokens - sliding_window + 1)


def num_blocks_out_of_window(num_computed_tokens: int, sliding_window: int | None, block_size: int) -> int:
    """Leading logical blocks wholly before the window of the next query: the ones a window group frees."""
    return window_start(num_computed_tokens, sliding_window) // block_size


def max_blocks_in_window(sliding_window: int, block_size: int, num_new_tokens: int = 1) -> int:
    """Most blocks a sequence of a window group holds while `num_new_tokens` tokens are uncomputed (1: a
    decode): the window's keys before them and the new tokens span at most this many blocks."""
    return -(-(sliding_window + num_new_tokens - 1) // block_size) + 1
