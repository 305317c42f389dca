"""Gemma 3's images as the server uses them (models/vision/adapter.py's `ImageEncoder`): the chat template writes
`<start_of_image>` for each image part; transformers' Gemma3Processor puts in its place a blank line, the
begin-of-image token, `mm_tokens_per_image` image soft tokens, the end-of-image token and a blank line
(`"\\n\\n<start_of_image>" + "<image_soft_token>" * n + "<end_of_image>\\n\\n"`), and the model takes the image's
embeddings in place of the soft tokens' (the span), which attend to each other both ways (transformers'
`token_type_ids` mask). The tokens' strings are the tokenizer's for the ids Gemma3Config names
(`boi_token_index`, `eoi_token_index`, `image_token_index`).

`load_gemma3_encoder` is registered for "Gemma3ForConditionalGeneration" in localserve/loading/image_encoders.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from localserve.models.vision.adapter import ImageEncoder, PreparedImage
from localserve.models.vision.gemma3_vision import GemmaVision
from localserve.models.vision.preprocess import preprocess
from PIL import Image


@dataclass(frozen=True)
class GemmaImageTokens:
    """The strings of Gemma 3's image tokens in the tokenizer, and the soft token's id."""

    boi: str  # "<start_of_image>": what the chat template writes for an image part
    eoi: str  # "<end_of_image>"
    soft: str  # "<image_soft_token>": one per row of the image's embeddings
    soft_id: int


class Gemma3ImageEncoder:
    """`ImageEncoder` of a Gemma3ForConditionalGeneration checkpoint over its `GemmaVision`."""

    def __init__(self, vision: GemmaVision, tokens: GemmaImageTokens) -> None:
        self.vision = vision
        self.tokens = tokens
        self.marker = tokens.boi
        self.hidden_size = vision.config.text_hidden_size
        count = vision.config.mm_tokens_per_image
        self._text = f"\n\n{tokens.boi}{tokens.soft * count}{tokens.eoi}\n\n"
        self._span_ids = (tokens.soft_id,) * count

    def prepare(self, picture: Image.Image) -> PreparedImage:
        """The picture's pixel values [1, 3, size, size] (Gemma3ImageProcessor's processing, models/vision/
        preprocess.py) and the text Gemma3Processor writes for it."""
        pixel_values = preprocess([picture], self.vision.processing)
        return PreparedImage(text=self._text, span_ids=self._span_ids, inputs=pixel_values, bidirectional=True)

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """The span's embeddings [mm_tokens_per_image, text hidden size] on the vision weights' device."""
        return self.vision.encode(prepared.inputs)[0]


def _token(tokenizer, token_id: int, field: str, source: str) -> str:
    from localserve.loading.vision import VisionLoadError

    token = tokenizer.backend.id_to_token(token_id)
    if token is None:
        raise VisionLoadError(f"{source}: config.json's {field} {token_id} is not a token of the tokenizer "
                             f"({tokenizer.vocab_size} tokens)")
    return token


def gemma_image_tokens(folder: Path, config: dict) -> GemmaImageTokens:
    """The image tokens of the folder's tokenizer at the ids its config.json names."""
    from localserve.models.vision.config import gemma3_vision_config

    from localserve.tokenizer.tokenizer import Tokenizer

    source = str(folder / "config.json")
    vision = gemma3_vision_config(config, source)
    tokenizer = Tokenizer.from_hf_folder(folder)
    return GemmaImageTokens(boi=_token(tokenizer, vision.boi_token_id, "boi_token_index", source),
                            eoi=_token(tokenizer, vision.eoi_token_id, "eoi_token_index", source),
                            soft=_token(tokenizer, vision.image_token_id, "image_token_index", source),
                            soft_id=vision.image_token_id)


def load_gemma3_encoder(path: Path, config: dict, dtype: torch.dtype,
                        device: torch.device | str) -> ImageEncoder | None:
    """The encoder of a Gemma3ForConditionalGeneration folder; None where its config has no vision_config or its
    shards no vision tensor (a text-only save: served as text)."""
    from localserve.models.vision.gemma3_vision import checkpoint_target

    from localserve.loading.vision import has_vision_tensors, load_gemma_vision

    if config.get("vision_config") is None or not has_vision_tensors(path, checkpoint_target):
        return None
    tokens = gemma_image_tokens(path, config)
    return Gemma3ImageEncoder(load_gemma_vision(path, dtype=dtype, device=device), tokens)
