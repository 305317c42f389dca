"""Mistral 3's images as the server uses them (models/vision/adapter.py's `ImageEncoder`): the chat template
(Mistral Small 3.1 / 3.2's) writes `[IMG]` for each image part; transformers' PixtralProcessor puts in its
place the image's token rows: for a picture of rows x cols image tokens, each row is cols `[IMG]` followed
by `[IMG_BREAK]`, but the last row ends with `[IMG_END]` instead. The model takes the image's features in
place of the `[IMG]` tokens' embeddings; the break and end tokens keep their token embeddings.

The span (the tokens whose input embeddings the encoder gives) runs from the first `[IMG]` to the last, its
breaks included, so it is one run per image: its rows are the image's features at `[IMG]` places and the
language model's token embedding of `[IMG_BREAK]` at break places (Mistral's decoder does not scale its
token embeddings, so the engine places that row as transformers has it). `[IMG_END]` is outside the span.
The tokens' strings are the processor config's (`image_token`, `image_break_token`, `image_end_token`),
else PixtralProcessor's defaults; the image token's id must be config.json's `image_token_index`.

`load_mistral3_encoder` is registered for "Mistral3ForConditionalGeneration" in
localserve/loading/image_encoders.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from localserve.models.vision.adapter import ImageEncoder, PreparedImage
from localserve.models.vision.mistral3_vision import Mistral3Vision
from localserve.models.vision.pixtral_preprocess import pixtral_preprocess
from PIL import Image

DEFAULT_TOKENS = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}


@dataclass(frozen=True)
class PixtralImageTokens:
    """The strings and ids of Pixtral's three image tokens in the tokenizer."""

    image: str
    image_id: int
    row_break: str
    row_break_id: int
    end: str
    end_id: int


def image_text(tokens: PixtralImageTokens, rows: int, cols: int) -> str:
    """What PixtralProcessor writes for a picture of rows x cols image tokens."""
    row = tokens.image * cols
    return (row + tokens.row_break) * (rows - 1) + row + tokens.end


def span_ids(tokens: PixtralImageTokens, rows: int, cols: int) -> tuple[int, ...]:
    """The span's ids: `image_text`'s tokens without the closing end token."""
    row = (tokens.image_id,) * cols
    return (row + (tokens.row_break_id,)) * (rows - 1) + row


class Mistral3ImageEncoder:
    """`ImageEncoder` of a Mistral3ForConditionalGeneration checkpoint over its `Mistral3Vision`;
    `break_embedding` is the language model's input embedding of the row break token [text hidden]."""

    def __init__(self, vision: Mistral3Vision, tokens: PixtralImageTokens, break_embedding: torch.Tensor) -> None:
        self.vision = vision
        self.tokens = tokens
        self.marker = tokens.image
        self.hidden_size = vision.config.text_hidden_size
        if tuple(break_embedding.shape) != (self.hidden_size,):
            raise ValueError(f"Mistral3ImageEncoder: the break token's embedding has shape "
                             f"{list(break_embedding.shape)}; the language model's hidden size is {self.hidden_size}")
        self.break_embedding = break_embedding

    def prepare(self, picture: Image.Image) -> PreparedImage:
        """The picture's pixel values [3, height, width] (PixtralImageProcessor's processing, models/vision/
        pixtral_preprocess.py) and the text PixtralProcessor writes for it."""
        pixel_values = pixtral_preprocess(picture, self.vision.processing)
        rows, cols = self.vision.config.token_grid(*pixel_values.shape[1:])
        return PreparedImage(text=image_text(self.tokens, rows, cols), span_ids=span_ids(self.tokens, rows, cols),
                             inputs=pixel_values)

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """The span's embeddings [rows x (cols + 1) - 1, text hidden size] on the vision weights' device: each
        row's image features, then the break token's embedding (but after the last row)."""
        pixel_values = prepared.inputs
        rows, cols = self.vision.config.token_grid(*pixel_values.shape[1:])
        [features] = self.vision.encode([pixel_values])
        breaks = self.break_embedding.to(features.device, features.dtype).expand(rows, 1, -1)
        span = torch.cat((features.view(rows, cols, -1), breaks), dim=1).reshape(rows * (cols + 1), -1)
        return span[:-1]


def _token_id(tokenizer, token: str, field: str, source: str) -> int:
    from localserve.loading.vision import VisionLoadError

    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise VisionLoadError(f"{source}: the tokenizer has no {field} {token!r}")
    if tokenizer.encode(token * 2, add_special_tokens=False) != [token_id] * 2:
        raise VisionLoadError(f"{source}: the tokenizer does not read {token!r} as one token ({field})")
    return token_id


def pixtral_image_tokens(folder: Path, image_token_id: int) -> PixtralImageTokens:
    """The image tokens of the folder's tokenizer, by the strings its processor config names (else
    PixtralProcessor's defaults); the image token's id must be `image_token_id` (config.json's)."""
    from localserve.loading.pixtral_vision import processor_fields
    from localserve.loading.vision import VisionLoadError
    from localserve.tokenizer.tokenizer import Tokenizer

    fields = DEFAULT_TOKENS | {key: value for key, value in processor_fields(folder).items()
                               if key in DEFAULT_TOKENS and isinstance(value, str)}
    tokenizer = Tokenizer.from_hf_folder(folder)
    source = str(folder)
    ids = {field: _token_id(tokenizer, token, field, source) for field, token in fields.items()}
    if ids["image_token"] != image_token_id:
        raise VisionLoadError(f"{folder / 'config.json'}: image_token_index {image_token_id} is not the tokenizer's "
                              f"{fields['image_token']!r} ({ids['image_token']})")
    return PixtralImageTokens(image=fields["image_token"], image_id=ids["image_token"],
                              row_break=fields["image_break_token"], row_break_id=ids["image_break_token"],
                              end=fields["image_end_token"], end_id=ids["image_end_token"])


def load_mistral3_encoder(path: Path, config: dict, dtype: torch.dtype,
                          device: torch.device | str) -> ImageEncoder | None:
    """The encoder of a Mistral3ForConditionalGeneration folder; None where its config has no vision_config or
    its shards no vision tensor (a text-only save: served as text)."""
    from localserve.models.vision.mistral3_vision import checkpoint_target

    from localserve.loading.pixtral_vision import load_mistral3_vision, token_embedding
    from localserve.loading.vision import has_vision_tensors

    if config.get("vision_config") is None or not has_vision_tensors(path, checkpoint_target):
        return None
    vision = load_mistral3_vision(path, dtype=dtype, device=device, config_dict=config)
    tokens = pixtral_image_tokens(path, vision.config.image_token_id)
    return Mistral3ImageEncoder(vision, tokens, token_embedding(path, tokens.row_break_id, dtype, device))
