"""Qwen3.5/3.6's `ImageEncoder` (models/vision/adapter.py): what the server and the engine use of the vision
transformer (models/vision/qwen3_5_vision.py) and its preprocessing (models/vision/qwen_preprocess.py).

The chat template writes `<|vision_start|><|image_pad|><|vision_end|>` for an image part; the marker is the
image pad token's text, which `prepare` expands as transformers' Qwen3VLProcessor (the processor of both
Qwen3.5 architectures) does: one image pad per merged token (grid t x h x w / spatial_merge_size^2). The span
is those pad tokens; the vision start and end tokens stay text. Each span carries its tokens' mRoPE offsets
(temporal, height, width, from the image's first position: `image_rope_positions` at 0), which the engine
turns into the request's positions (engine/mrope.py).
"""

from __future__ import annotations

import torch
from localserve.models.vision.adapter import PreparedImage
from localserve.models.vision.qwen3_5_vision import QwenVision, image_rope_positions
from localserve.models.vision.qwen_preprocess import qwen_preprocess
from PIL import Image

IMAGE_PAD = "<|image_pad|>"  # the released checkpoints' text of the image token (their chat template's)


class QwenImageEncoder:
    """A loaded `QwenVision` (with its `.processing`) as an `ImageEncoder`; `marker` is the text of the
    config's image token in the checkpoint's tokenizer (module doc)."""

    def __init__(self, vision: QwenVision, marker: str = IMAGE_PAD) -> None:
        if vision.processing is None:
            raise ValueError("QwenImageEncoder: the vision model has no image processing (its loader sets it)")
        self.vision = vision
        self.marker = marker
        self.hidden_size = vision.config.out_hidden_size

    def prepare(self, picture: Image.Image) -> PreparedImage:
        """The picture's patch rows and grid, the marker repeated once per token, the image token ids, and
        the tokens' mRoPE offsets [3, tokens]."""
        pixel_values, grid_thw = qwen_preprocess([picture], self.vision.processing)
        config = self.vision.config
        grid = tuple(int(n) for n in grid_thw[0].tolist())
        num_tokens = config.tokens_per_image(grid)
        offsets, _ = image_rope_positions(grid, 0, config.spatial_merge_size)
        return PreparedImage(text=self.marker * num_tokens, span_ids=(config.image_token_id,) * num_tokens,
                             inputs=(pixel_values, grid_thw), rope_positions=offsets)

    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """The span's input embeddings [tokens, out_hidden_size] on the vision model's device."""
        pixel_values, grid_thw = prepared.inputs
        [embeddings] = self.vision.encode(pixel_values, grid_thw)
        return embeddings
