"""A prompt's images made ready for one model's encoder (models/vision/adapter.py's `ImageEncoder`), whoever
builds the prompt (the server: server/generation/image_prompt.py; the offline API: `LLM.chat`):

- `ImagePrompt.expand`, run by the tokenizer on the rendered chat (`Tokenizer.encode_chat(expand=)`), puts image
  i's text (`PreparedImage.text`) in place of the i-th marker the chat template wrote;
- `ImagePrompt.multimodal` finds image i's span (the first run of its `span_ids` after image i-1's) in the
  prompt's ids and gives the engine its `ImageSpan`s (content hash: engine/image_hash.py's `pixel_hash`) and the
  encoder's embeddings, made on the engine thread on first use.

The server reaches `ImageEncoder` and `PreparedImage` through this module (it imports no model code).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localserve.engine.multimodal import ImageSpan, MultiModalInputs
from localserve.models.vision.adapter import ImageEncoder, PreparedImage

__all__ = ["ImageCountError", "ImageEncoder", "ImagePrompt", "PreparedImage", "SpanNotFoundError", "find_run"]


class ImageCountError(ValueError):
    """The chat template wrote `found` markers for `expected` images."""

    def __init__(self, marker: str, found: int, expected: int) -> None:
        super().__init__(f"the chat template placed {found} image marker{'s' if found != 1 else ''} ({marker!r}) "
                         f"for {expected} image{'s' if expected != 1 else ''}")
        self.found, self.expected = found, expected


class SpanNotFoundError(LookupError):
    """Image `index`'s span is not in the prompt's ids (the tokenizer split the image's text)."""

    def __init__(self, index: int, length: int, start: int) -> None:
        super().__init__(f"image {index}: its {length} tokens are not in the tokenized prompt after token {start} "
                         "(the tokenizer split the image's text)")
        self.index = index


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's images, in prompt order: each one's content hash and what `encoder.prepare` made of it."""

    encoder: ImageEncoder
    hashes: tuple[bytes, ...]
    prepared: tuple[PreparedImage, ...]

    def expand(self, rendered: str) -> str:
        """The rendered chat with the i-th marker replaced by image i's text; ImageCountError when the template
        wrote another number of markers than there are images."""
        pieces = rendered.split(self.encoder.marker)
        if len(pieces) - 1 != len(self.prepared):
            raise ImageCountError(self.encoder.marker, len(pieces) - 1, len(self.prepared))
        return pieces[0] + "".join(prepared.text + piece for prepared, piece in zip(self.prepared, pieces[1:]))

    def spans(self, prompt_ids: Sequence[int]) -> tuple[ImageSpan, ...]:
        """Each image's span in the prompt's ids; SpanNotFoundError naming the first that is not there."""
        spans, start = [], 0
        for index, (content_hash, prepared) in enumerate(zip(self.hashes, self.prepared)):
            offset = find_run(prompt_ids, prepared.span_ids, start)
            if offset is None:
                raise SpanNotFoundError(index, len(prepared.span_ids), start)
            spans.append(ImageSpan(offset, len(prepared.span_ids), content_hash,
                                   bidirectional=prepared.bidirectional))
            start = offset + len(prepared.span_ids)
        return tuple(spans)

    def multimodal(self, prompt_ids: Sequence[int]) -> MultiModalInputs:
        """The engine's inputs: the spans, and their embeddings made by the encoder on first use."""
        encoder, prepared = self.encoder, self.prepared
        rope = tuple(image.rope_positions for image in prepared)  # Qwen3.5's mRoPE offsets
        return MultiModalInputs(self.spans(prompt_ids), lambda index: encoder.encode(prepared[index]),
                                rope_positions=rope if all(rows is not None for rows in rope) else None)


def find_run(ids: Sequence[int], run: Sequence[int], start: int) -> int | None:
    """The first index >= `start` where `ids` holds `run` contiguously, or None."""
    ids, run = list(ids), list(run)
    if not run:
        return None
    position = start
    while True:
        try:
            position = ids.index(run[0], position)
        except ValueError:
            return None
        if ids[position:position + len(run)] == run:
            return position
        position += 1
