"""A request's image tokens in the monitor feed: its `image_spans` (docs/PROTOCOL.md, "/v1/monitor") and
the KV blocks that hold them.

A span is `(offset, length)`: the image's tokens are prompt tokens `offset .. offset + length - 1`. The
block at index `j` of a sequence's block table (group 0's: a full-attention group whenever the model has
one, so index `j` holds tokens `j * block_size .. (j + 1) * block_size - 1`) holds image tokens when that
range meets a span. Every sequence of a request shares its prompt, so the same indices hold image tokens in
each of its tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


class ImageSpanError(ValueError):
    """`image_spans` that do not follow the protocol; the message names the entry."""


def parse_image_spans(value: Any, where: str, num_prompt_tokens: int) -> tuple[tuple[int, int], ...]:
    """`value` (the request's `image_spans`) checked: a list of `[offset, length]` pairs of ints, each
    inside the prompt of `num_prompt_tokens` tokens, in order and apart."""
    if not isinstance(value, list):
        raise ImageSpanError(f"{where}.image_spans must be a list, got {type(value).__name__}")
    spans: list[tuple[int, int]] = []
    end = 0
    for index, span in enumerate(value):
        name = f"{where}.image_spans[{index}]"
        if not (isinstance(span, list) and len(span) == 2 and all(type(number) is int for number in span)):
            raise ImageSpanError(f"{name} must be [offset, length] (two ints), got {span!r}")
        offset, length = span
        if offset < end or length < 1 or offset + length > num_prompt_tokens:
            raise ImageSpanError(f"{name} = {span} must lie in the prompt of {num_prompt_tokens} tokens, "
                                 f"after the span before it (from {end}), with a length >= 1")
        spans.append((offset, length))
        end = offset + length
    return tuple(spans)


def image_block_indices(spans: Iterable[tuple[int, int]], block_size: int) -> set[int]:
    """The indices in a block table of the blocks that hold tokens of `spans`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return {index for offset, length in spans
            for index in range(offset // block_size, (offset + length - 1) // block_size + 1)}


def image_block_ids(tables: Sequence[Sequence[int]], spans: Iterable[tuple[int, int]],
                    block_size: int) -> frozenset[int]:
    """The physical blocks of `tables` (a request's block tables) that hold image tokens."""
    indices = image_block_indices(spans, block_size)
    return frozenset(table[index] for table in tables for index in indices if index < len(table))
