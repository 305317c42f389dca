"""Layer groups: the layers of a model grouped by how they keep KV, each group with its own block pool.

A group is "full" (every token's KV is kept while the sequence lives) or "window W" (a query at position
p sees only the keys at positions p - W + 1 .. p, the last W keys, itself included: transformers'
sliding-window mask for Mistral, Qwen2, gpt-oss and Gemma 3 alike). A window group frees the blocks that
fall wholly before the window of the sequence's next query, so its memory per sequence is bounded by the
window. No torch here: the engine derives each layer's window from the model config and hands the list in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One group: its window (None: full attention) and the layers in it, in layer order."""

    sliding_window: int | None
    layers: tuple[int, ...]

    @property
    def label(self) -> str:
        return group_label(self.sliding_window)


def group_label(sliding_window: int | None) -> str:
    """'full' or 'window 128', as the monitor and the plan name a group."""
    return "full" if sliding_window is None else f"window {sliding_window}"


def group_layers(layer_windows: Sequence[int | None]) -> list[KVGroup]:
    """The groups of a model whose layer i has window `layer_windows[i]` (None: full attention).

    Group 0 is the full-attention group where the model has a full layer; the window groups follow in
    increasing window order. Raises ValueError on an empty model or a window below 1.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer to group")
    for layer, window in enumerate(layer_windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {layer}: sliding window must be >= 1, got {window}")
    windows = sorted(set(layer_windows), key=lambda window: (window is not None, window or 0))
    return [KVGroup(window, tuple(layer for layer, w in enumerate(layer_windows) if w == window))
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
