"""Image inputs on the engine side: which prompt tokens take their input embeddings from an image, the
prefix-cache keys of the blocks covering them, and the embeddings of recently seen images.

A request's image is a span of placeholder tokens in its prompt (`ImageSpan`: offset, length and a hash of
the image's content); the server puts as many placeholder ids there as the model's encoder makes rows.
The engine never reads pixels: it is handed each span's embeddings ([length, hidden size], the encoder's
output already projected into the language model's space) or a callable making them on first use.

- Prefix cache: a full block overlapping a span gets, besides its tokens, the span's content hash and the
  block's place in the span in its key (`block_extra_keys`, kv/block_hash.py's `block_extra_key`), so
  the same placeholder ids with other pixels never hit, and the same pixels do (the next turn, another
  client). Text-only blocks keep their keys byte for byte.
- The forward pass: for each step's tokens inside a span (a prefill chunk may start or end inside one),
  the model runner hands the model those rows of the span's embeddings (`gather_input_embeds`, a
  `models.protocol.InputEmbeds`) in place of the token embeddings. Each family places them
  (models/layers/decoder.py, `place_input_embeds`) after its own token-embedding scale: Gemma 3 scales
  token embeddings by sqrt(hidden size) and not the image's (transformers' Gemma3Model scatters the image
  features into the scaled embeddings).
- Bidirectional spans (`ImageSpan.bidirectional`, Gemma 3's images): each token of the span sees every token
  of it, causal otherwise, as transformers' Gemma 3 `token_type_ids` mask on full and sliding layers. The
  scheduler never ends a prefill chunk strictly inside one (engine/batch.py, `span_safe_chunk`; a span
  longer than the step's token budget is refused by `validate_multimodal`), so a chunk holding a span's
  tokens holds the rest of it, and `key_limits` lets each of them see up to the span's last token
  (`AttentionInputs.key_limits`, read by both attention backends). A chunk may start inside one after a
  prefix hit: the cached tokens before were computed, by whichever request, seeing the whole span.
- mRoPE (Qwen3.5): `MultiModalInputs.rope_positions` gives each span's tokens their 3D rotary offsets; the
  request's position map (`mrope`, engine/mrope.py) is made from them, and the model runner hands the model
  those positions (text after an image shifted, decodes too).
- `EmbeddingCache`: an image's embeddings by content hash, least recently used first out, bounded in bytes,
  so an image seen recently (the same request's later chunks, a preemption's recompute, another turn) is
  not encoded again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from localserve.engine.config import IMAGE_CACHE_BYTES
from localserve.engine.mrope import MRopeMap
from localserve.models.protocol import InputEmbeds

INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # what rope_positions may be


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """The prompt's tokens [offset, offset + length) are placeholders whose input embeddings come from an
    image; `content_hash` names the image's content (a hash of its decoded pixels and size, not of its file)."""

    offset: int
    length: int
    content_hash: bytes
    bidirectional: bool = False  # its tokens attend to each other both ways (Gemma 3's images)

    @property
    def end(self) -> int:
        return self.offset + self.length


EmbeddingsSource = Callable[[int], torch.Tensor] | Sequence[torch.Tensor]
"""Each span's embeddings [length, hidden size]: a tensor per span, or a callable span index -> tensor, called
at most once per image while its embeddings stay in the engine's cache."""


@dataclass(frozen=True, slots=True, eq=False)
class MultiModalInputs:
    """A request's images: its spans, in prompt order, and their embeddings (`EmbeddingsSource`).

    `rope_positions` (a model with multimodal rotary, Qwen3.5): per span, its tokens' (temporal, height,
    width) offsets [3, length] from the position its first token takes (PreparedImage.rope_positions);
    `mrope`, the request's position map made from them (engine/mrope.py); ValueError naming the span for
    offsets of another shape or negative ones."""

    spans: tuple[ImageSpan, ...]
    embeddings: EmbeddingsSource
    rope_positions: tuple[torch.Tensor, ...] | None = None
    mrope: MRopeMap | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rope_positions is not None:
            check_rope_positions(self.spans, self.rope_positions)
            object.__setattr__(self, "mrope", MRopeMap(self.spans, self.rope_positions))

    def span_embeddings(self, index: int) -> torch.Tensor:
        """Span `index`'s embeddings as its source gives them (unchecked: see `check_span_embeddings`)."""
        source = self.embeddings
        return source(index) if callable(source) else source[index]


def describe_span(index: int, span: ImageSpan) -> str:
    """How errors name a span: its index and its tokens."""
    return f"image span {index} (tokens [{span.offset}, {span.end}))"


def validate_multimodal(multimodal: MultiModalInputs, num_prompt_tokens: int, hidden_size: int,
                        max_bidirectional_tokens: int | None = None) -> None:
    """Raise ValueError naming the span unless each span lies inside the prompt, after the previous one
    without overlap, with a non-empty content hash, and (where given as tensors) embeddings of [length,
    hidden size]; a bidirectional span at most `max_bidirectional_tokens` long (the step's token budget
    with chunked prefill: such a span is computed in one step; None: no bound). A callable's tensors are
    checked when it makes them (`check_span_embeddings`)."""
    if not isinstance(multimodal, MultiModalInputs):
        raise ValueError(f"multimodal: expected MultiModalInputs, got {type(multimodal).__name__}")
    spans, source = multimodal.spans, multimodal.embeddings
    if not callable(source) and len(source) != len(spans):
        raise ValueError(f"multimodal: {len(spans)} image spans but {len(source)} embeddings tensors")
    previous_end = 0
    for index, span in enumerate(spans):
        name = describe_span(index, span)
        if not isinstance(span, ImageSpan):
            raise ValueError(f"multimodal: span {index} is a {type(span).__name__}, not an ImageSpan")
        if not all(isinstance(value, int) and not isinstance(value, bool) for value in (span.offset, span.length)):
            raise ValueError(f"{name}: its offset and length must be ints")
        if span.length < 1:
            raise ValueError(f"{name}: its length must be at least 1")
        if span.offset < 0 or span.end > num_prompt_tokens:
            raise ValueError(f"{name} lies outside the prompt of {num_prompt_tokens} tokens")
        if span.offset < previous_end:
            raise ValueError(f"{name} overlaps the span before it or comes before it (spans go in prompt order)")
        if not isinstance(span.content_hash, bytes) or not span.content_hash:
            raise ValueError(f"{name}: its content_hash must be non-empty bytes")
        if span.bidirectional and max_bidirectional_tokens is not None and span.length > max_bidirectional_tokens:
            raise ValueError(f"{name} is bidirectional and {span.length} tokens long, more than a step's "
                             f"{max_bidirectional_tokens} tokens (max_num_batched_tokens): its tokens see each "
                             "other, so it is computed in one step")
        if not callable(source):
            check_span_embeddings(source[index], index, span, hidden_size)
        previous_end = span.end


def check_span_embeddings(embeddings: object, index: int, span: ImageSpan, hidden_size: int) -> None:
    """Raise ValueError naming the span unless `embeddings` is a floating tensor of [span.length, hidden_size]."""
    name = describe_span(index, span)
    if not isinstance(embeddings, torch.Tensor) or not embeddings.is_floating_point():
        raise ValueError(f"{name}: its embeddings must be a floating-point tensor, got {type(embeddings).__name__}")
    if tuple(embeddings.shape) != (span.length, hidden_size):
        raise ValueError(f"{name}: embeddings of shape {tuple(embeddings.shape)}, expected ({span.length}, "
                         f"{hidden_size}) (a row per token, the model's hidden size)")


def bidirectional_spans(spans: Sequence[ImageSpan]) -> tuple[tuple[int, int], ...]:
    """(offset, end) of each bidirectional span, in prompt order: what the scheduler's chunk rule reads."""
    return tuple((span.offset, span.end) for span in spans if span.bidirectional)


def image_spans(spans: Sequence[ImageSpan]) -> tuple[tuple[int, int, bytes], ...]:
    """(offset, end, content hash) of each span, in prompt order: what the step's time budget charges an
    image's encode by (engine/encode_budget.py)."""
    return tuple((span.offset, span.end, span.content_hash) for span in spans)


def check_rope_positions(spans: Sequence[ImageSpan], rope_positions: Sequence[torch.Tensor]) -> None:
    """Raise ValueError naming the span unless there is one integer tensor [3, span.length] of non-negative
    offsets per span (MultiModalInputs.rope_positions)."""
    if not isinstance(rope_positions, tuple):
        raise ValueError(f"multimodal: rope_positions must be a tuple of tensors, got {type(rope_positions).__name__}")
    if len(rope_positions) != len(spans):
        raise ValueError(f"multimodal: {len(spans)} image spans but {len(rope_positions)} rope_positions tensors")
    for index, (span, rows) in enumerate(zip(spans, rope_positions)):
        name = describe_span(index, span)
        if not isinstance(rows, torch.Tensor) or rows.dtype not in INTEGER_DTYPES:
            raise ValueError(f"{name}: its rope_positions must be an integer tensor, got "
                             f"{getattr(rows, 'dtype', type(rows).__name__)}")
        if tuple(rows.shape) != (3, span.length):
            raise ValueError(f"{name}: rope_positions of shape {tuple(rows.shape)}, expected (3, {span.length}) "
                             f"(temporal, height, width offsets per token)")
        if rows.numel() and int(rows.min()) < 0:
            raise ValueError(f"{name}: rope_positions must be offsets >= 0 from the span's first position")


def block_extra_keys(spans: Sequence[ImageSpan], block_size: int) -> tuple[bytes, ...]:
    """Each block's own prefix-cache key part, up to the last block a span overlaps (empty: no span there).

    A block's part holds, for each span it overlaps: the span's content hash, its length, and where the
    overlap starts in the span and in the block. So two blocks with the same placeholder ids have equal
    keys only when the same pixels sit at the same places in them."""
    if not spans:
        return ()
    keys = [bytearray() for _ in range(-(-spans[-1].end // block_size))]
    for span in spans:
        for block in range(span.offset // block_size, -(-span.end // block_size)):
            start = max(span.offset, block * block_size)
            keys[block] += (len(span.content_hash).to_bytes(4, "little") + span.content_hash
                            + b"".join(value.to_bytes(8, "little") for value in
                                       (span.length, start - span.offset, start - block * block_size)))
    return tuple(bytes(key) for key in keys)


class EmbeddingCache:
    """Images' embeddings by content hash, least recently used evicted first once over `max_bytes`.

    An entry bigger than the bound is used but not kept (so made again when the step's forward pass reads
    it). `num_encoded` counts the embeddings made (the source called), `num_encoded_tokens` their rows,
    `num_hits` those found here, `encode_s` the seconds the sources took (the encoder's time, on the engine
    thread)."""

    def __init__(self, max_bytes: int = IMAGE_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_encoded = 0
        self.num_encoded_tokens = 0
        self.num_hits = 0
        self.encode_s = 0.0  # seconds in the sources (the encoder)
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def get(self, multimodal: MultiModalInputs, index: int, hidden_size: int, device: torch.device,
            dtype: torch.dtype, count_hit: bool = True) -> torch.Tensor:
        """Span `index`'s embeddings on `device` in `dtype`: from the cache (a hit, counted if `count_hit`),
        else made by its source, checked (ValueError naming the span) and kept."""
        span = multimodal.spans[index]
        cached = self._entries.get(span.content_hash)
        if cached is not None and cached.shape[0] == span.length:
            self._entries.move_to_end(span.content_hash)
            self.num_hits += count_hit
            return cached
        start = time.perf_counter()
        try:
            embeddings = multimodal.span_embeddings(index)
        finally:
            self.encode_s += time.perf_counter() - start
        self.num_encoded += 1
        self.num_encoded_tokens += span.length
        check_span_embeddings(embeddings, index, span, hidden_size)
        embeddings = embeddings.to(device=device, dtype=dtype)
        self._put(span.content_hash, embeddings)
        return embeddings

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def _put(self, content_hash: bytes, embeddings: torch.Tensor) -> None:
        size = embeddings.numel() * embeddings.element_size()
        old = self._entries.pop(content_hash, None)
        if old is not None:
            self.num_bytes -= old.numel() * old.element_size()
        if size > self.max_bytes:
            return
        while self._entries and self.num_bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.numel() * evicted.element_size()
        self._entries[content_hash] = embeddings
        self.num_bytes += size


class ChunkOfRequest(Protocol):
    """What the runner's helpers read of a step's chunk (engine/step.py's `SeqChunk`, which imports this module
    for its `multimodal` field: a structural type keeps the two apart)."""

    start_pos: int
    token_ids: Sequence[int]
    multimodal: MultiModalInputs | None


def chunk_spans(chunk: ChunkOfRequest) -> Iterator[tuple[int, ImageSpan, int, int]]:
    """(index, span, low, high) for each image span of the chunk's request that the chunk's tokens overlap:
    positions [low, high) of the prompt."""
    multimodal = chunk.multimodal
    start, end = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
    if multimodal is None or start >= multimodal.spans[-1].end:  # decodes past the images: nothing
        return
    for index, span in enumerate(multimodal.spans):
        low, high = max(start, span.offset), min(end, span.end)
        if low < high:
            yield index, span, low, high


def key_limits(chunks: Sequence[ChunkOfRequest], positions: np.ndarray) -> np.ndarray | None:
    """The last key position each of the step's query tokens sees (`positions`: theirs, chunk after chunk): its
    own, or inside a bidirectional span the span's last token's (capped by the chunk's context, which the
    scheduler makes reach the span's end: engine/batch.py); None where every token sees up to its own.

    transformers' Gemma 3 masks an image's tokens the same way (`token_type_ids`): OR(causal, same image) on
    its full layers and AND(window, OR(causal, same image)) on its sliding ones, so only this upper bound
    changes; a window's lower bound stays each query's own position - W + 1."""
    limits = None
    base = 0
    for chunk in chunks:
        num_tokens = len(chunk.token_ids)
        if num_tokens > 1:  # a single token sees up to itself: the span's keys after it are not computed yet
            for _, span, low, high in chunk_spans(chunk):
                if span.bidirectional:
                    if limits is None:
                        limits = positions.copy()
                    last = min(span.end, chunk.start_pos + num_tokens) - 1
                    limits[base + low - chunk.start_pos:base + high - chunk.start_pos] = last
        base += num_tokens
    return limits


def gather_input_embeds(chunks: Sequence[ChunkOfRequest], cache: EmbeddingCache, hidden_size: int, device: torch.device,
                        dtype: torch.dtype) -> InputEmbeds | None:
    """The step's rows (in the flat batch of the chunks' tokens, chunk after chunk) that fall inside an image
    span of their chunk's `multimodal`, and those rows of the spans' embeddings; None where there are none."""
    rows: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    base = 0
    for chunk in chunks:
        for index, span, low, high in chunk_spans(chunk):
            # Found where the engine made them before the step (ModelRunner.encode_images, where hits count).
            embeddings = cache.get(chunk.multimodal, index, hidden_size, device, dtype, count_hit=False)
            rows.append(torch.arange(base + low - chunk.start_pos, base + high - chunk.start_pos, dtype=torch.int64))
            values.append(embeddings[low - span.offset:high - span.offset])
        base += len(chunk.token_ids)
    if not rows:
        return None
    return InputEmbeds(torch.cat(rows).to(device), torch.cat(values))
