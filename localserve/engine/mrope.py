"""Multimodal rotary positions (mRoPE, Qwen3.5/3.6) of a request with images, as the model runner hands them to
the model: a function of the prompt's image spans alone, so every step that computes a token gives it the
same position (prefill in any chunks, decodes, a preemption's recompute, a swap, a prefix hit).

transformers' Qwen3.5 `get_rope_index`: text tokens take consecutive positions, the same on the three axes
(temporal, height, width); an image's tokens, whose first sits where the next text position would be
`start`, take start + their own (temporal, height, width) offsets (the encoder's
`PreparedImage.rope_positions`), and the text after the image resumes at start + its largest offset + 1. So a
text token's position is its index in the sequence plus the shift of the images before it (per image: its
largest offset + 1 - its number of tokens), generated tokens included.

What the runner gives the model (`step_rope_positions`): nothing for a step without such a request (plain
positions, no cost); the shifted 1D positions [T] when none of the step's tokens is an image's; else [3, T].
The KV cache keeps its own positions (each token's index, `AttentionInputs.positions`): its slots, and the
4-bit key codecs that rotate a key mean by position (kv/codecs.py), encode and decode with those, so they
stay exact; only the model's rotary embedding turns by these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class SpanBounds(Protocol):
    """What the map reads of an image span (engine/multimodal.py's `ImageSpan`)."""

    offset: int
    length: int


class MRopeMap:
    """A request's mRoPE positions (module doc): spans [offset, offset + length) of the prompt, each with its
    tokens' offsets [3, length] (non-negative integers) from the position its first token starts at."""

    def __init__(self, spans: Sequence[SpanBounds], offsets: Sequence[torch.Tensor]) -> None:
        self.starts = np.array([span.offset for span in spans], np.int64)
        self.ends = np.array([span.offset + span.length for span in spans], np.int64)
        self.offsets = [np.asarray(rows.detach().cpu(), dtype=np.int64) for rows in offsets]
        deltas = [int(rows.max()) + 1 - rows.shape[1] if rows.size else 0 for rows in self.offsets]
        # shifts[i]: the text positions' shift after i images (shifts[0] = 0)
        self.shifts = np.concatenate(([0], np.cumsum(deltas, dtype=np.int64)))
        self.final_shift = int(self.shifts[-1])  # every token after the last image: its index + this
        self.last_end = int(self.ends[-1]) if len(spans) else 0

    def touches_image(self, start: int, count: int) -> bool:
        """Whether any of the sequence's tokens [start, start + count) is an image's."""
        return bool(np.any((self.starts < start + count) & (self.ends > start)))

    def positions(self, start: int, count: int) -> np.ndarray:
        """The (temporal, height, width) positions [3, count] of the sequence's tokens [start, start + count)."""
        index = np.arange(start, start + count, dtype=np.int64)
        text = index + self.shifts[np.searchsorted(self.ends, index, side="right")]
        out = np.broadcast_to(text, (3, count)).copy()
        end = start + count
        for span, (low_span, high_span) in enumerate(zip(self.starts.tolist(), self.ends.tolist())):
            low, high = max(start, low_span), min(end, high_span)
            if low < high:
                first = low_span + int(self.shifts[span])  # where the image's first token starts
                out[:, low - start:high - start] = first + self.offsets[span][:, low - low_span:high - low_span]
        return out


class ChunkWithImages(Protocol):
    """What `step_rope_positions` reads of a step's chunk (engine/step.py's `SeqChunk`)."""

    start_pos: int
    token_ids: Sequence[int]
    multimodal: object  # MultiModalInputs | None; its `mrope` an MRopeMap or None


def step_rope_positions(chunks: Sequence[ChunkWithImages]) -> np.ndarray | None:
    """The positions the model's rotary embedding takes for a step of these chunks (their tokens flat, chunk
    after chunk): None where no chunk's request has an mRoPE map (the cache's positions serve), the shifted
    positions [T] where none of the step's tokens is an image's, else [3, T] (module doc)."""
    maps = [getattr(chunk.multimodal, "mrope", None) for chunk in chunks]
    if not any(map_ is not None for map_ in maps):
        return None
    flat: list[np.ndarray] = []
    three: list[tuple[int, np.ndarray]] = []  # (first row, [3, n]) of chunks that touch an image
    base = 0
    for chunk, map_ in zip(chunks, maps):
        count = len(chunk.token_ids)
        index = np.arange(chunk.start_pos, chunk.start_pos + count, dtype=np.int64)
        if map_ is None:
            flat.append(index)
        elif chunk.start_pos >= map_.last_end:  # past the images (every decode after them)
            flat.append(index + map_.final_shift)
        elif not map_.touches_image(chunk.start_pos, count):  # text between or before images
            flat.append(map_.positions(chunk.start_pos, count)[0])
        else:
            rows = map_.positions(chunk.start_pos, count)
            flat.append(rows[0])
            three.append((base, rows))
        base += count
    positions = np.concatenate(flat)
    if not three:
        return positions
    out = np.broadcast_to(positions, (3, base)).copy()
    for first, rows in three:
        out[:, first:first + rows.shape[1]] = rows
    return out
