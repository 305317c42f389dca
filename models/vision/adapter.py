"""What the server and the engine use of a loaded vision model (`ImageEncoder`), whatever its family.

A request's image goes through three hands:
- the server renders the chat with the image as a part (request/images.py's `with_image_parts`); the chat
  template writes the family's `marker` for it (Gemma 3: `<start_of_image>`; Qwen3.5: `<|image_pad|>`
  inside its vision start/end tokens; Mistral 3: `[IMG]`);
- `prepare(picture)` (on a worker thread: Pillow and the preprocessing) returns a `PreparedImage`: the text that
  replaces that marker in the rendered prompt before it is tokenized (as transformers' processors expand
  it), the token ids of the span whose input embeddings come from the image (found in the tokenized prompt,
  after the previous image's span), and what the encoder takes;
- `encode(prepared)` (on the engine thread, the first time a step reads the span and its embeddings are not
  in the engine's cache) returns the span's input embeddings [len(span_ids), the language model's hidden
  size]. Rows of the span that are text tokens (Pixtral's row breaks) get their token embeddings there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from PIL import Image


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One picture made ready for one model (see the module's docstring)."""

    text: str  # replaces one marker in the rendered prompt
    span_ids: tuple[int, ...]  # the span's token ids, as the tokenizer makes them from `text`
    inputs: Any  # what `encode` takes (pixel values, a patch grid, ...)
    bidirectional: bool = False  # the span's tokens attend to each other both ways (Gemma 3's images)
    rope_positions: torch.Tensor | None = None  # [3, len(span_ids)] mRoPE offsets from the span's start (Qwen3.5)


class ImageEncoder(Protocol):
    """A vision model's image side (module docstring)."""

    marker: str  # what the chat template writes for an image part
    hidden_size: int  # the language model's: each span row's width

    def prepare(self, picture: Image.Image) -> PreparedImage:
        """The picture (as decoded: any mode and size; the first frame) made ready: thread-safe, no GPU."""
        ...

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """The span's input embeddings [len(prepared.span_ids), hidden_size] on the model's device."""
        ...
