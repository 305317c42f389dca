"""Tiny random Qwen3.5 / Qwen3.5-MoE checkpoints with their vision tower (transformers' Qwen3_5Config /
Qwen3_5MoeConfig, float32, saved by save_pretrained with an image processor config), prompts with images as
our encoder makes them, and transformers' greedy reference (its processor's pixels, its generate); the vision
encoder tests' smaller Qwen3_5Config (one text layer) and image processor (a mean and std of its own).

The language model is tests/helpers/hybrid_models.py's (Gated DeltaNet layers with long memory, one gated
full-attention layer whose head of 32 turns a quarter: 4 rotary frequencies); `mrope_section` [2, 1, 1] gives
the height and width axes one frequency each, so both show in the logits.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from localserve.models.vision.adapter import ImageEncoder, PreparedImage
from PIL import Image

from localserve.engine.multimodal import ImageSpan, MultiModalInputs
from tests.helpers.hybrid_models import qwen3_5_config, qwen3_5_moe_config, save_hybrid

IDS = {"image_token_id": 300, "video_token_id": 301, "vision_start_token_id": 302, "vision_end_token_id": 303}
PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 48 * 48
MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.3, 0.25]  # unlike the class defaults, so a folder's are seen read
MROPE_SECTION = [2, 1, 1]
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
              temporal_patch_size=TEMPORAL, out_hidden_size=64, num_position_embeddings=16)


def tiny_config(moe: bool = False, ids: dict[str, int] | None = None, **text_changes):
    """A Qwen3_5(Moe)Config: the hybrid text model with interleaved mRoPE sections (`text_changes` to its
    fields), the tiny vision tower (its output as wide as the text model), the vision token `ids` (IDS)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": MROPE_SECTION, "mrope_interleaved": True}
    text = (qwen3_5_moe_config if moe else qwen3_5_config)(rope_parameters=rope, **text_changes)
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    vision = VISION | {"out_hidden_size": text.hidden_size}
    return config_class(text_config=text.to_dict(), vision_config=vision, **(ids or IDS))


def tiny_qwen3_5(depth: int = 2, **vision):
    """The vision encoder tests' Qwen3_5Config: the tiny tower of `depth` blocks (`vision` to its other fields) over
    one full-attention text layer (qwen3_5_config's), the vision token ids IDS."""
    import transformers

    text = qwen3_5_config(num_hidden_layers=1, layer_types=["full_attention"])
    return transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=VISION | {"depth": depth} | vision,
                                      **IDS)


def reference_processor():
    """transformers' image processor for the tiny tower (Pillow backend, as the Qwen3.5 processors pick)."""
    import transformers

    return transformers.Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                                 size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def custom_processor(**options):
    """reference_processor's with MEAN and STD (`options` to its fields): a folder saved with it shows its
    preprocessor config read."""
    import transformers

    fields = dict(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, image_mean=MEAN, image_std=STD,
                  size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}) | options
    return transformers.Qwen2VLImageProcessorPil(**fields)


def write_tiny_qwen3_5_vision(folder: Path, moe: bool = False, seed: int = 0, ids: dict[str, int] | None = None,
                              **text_changes):
    """A random Qwen3_5(Moe)ForConditionalGeneration (tiny_config's arguments) saved into `folder` with its
    preprocessor config; returns the transformers model."""
    import transformers

    model_class = (transformers.Qwen3_5MoeForConditionalGeneration if moe
                   else transformers.Qwen3_5ForConditionalGeneration)
    model = save_hybrid(folder, tiny_config(moe, ids, **text_changes), seed=seed, model_class=model_class)
    reference_processor().save_pretrained(folder)
    return model


def content_hash(picture: Image.Image) -> bytes:
    return hashlib.sha256(picture.tobytes() + repr((picture.mode, picture.size)).encode()).digest()


def image_prompt(parts: list, encoder: ImageEncoder) -> tuple[list[int], MultiModalInputs | None, list[Image.Image]]:
    """A prompt of text parts (token lists) and pictures, each picture written as the chat template and the
    processor write it (vision start, one image pad per token, vision end): its ids, the MultiModalInputs of
    our encoder (embeddings on first use, mRoPE offsets), and its pictures in order."""
    ids: list[int] = []
    spans, prepared, pictures = [], [], []
    for part in parts:
        if isinstance(part, Image.Image):
            ready: PreparedImage = encoder.prepare(part)
            ids.append(IDS["vision_start_token_id"])
            spans.append(ImageSpan(len(ids), len(ready.span_ids), content_hash(part)))
            ids += ready.span_ids
            ids.append(IDS["vision_end_token_id"])
            prepared.append(ready)
            pictures.append(part)
        else:
            ids += part
    if not spans:
        return ids, None, pictures
    multimodal = MultiModalInputs(tuple(spans), lambda index: encoder.encode(prepared[index]),
                                  rope_positions=tuple(ready.rope_positions for ready in prepared))
    return ids, multimodal, pictures


def transformers_greedy(hf_model, ids: list[int], pictures: list[Image.Image], max_new_tokens: int,
                        image_token_id: int = IDS["image_token_id"]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and each step's log-probabilities [vocab] from generate with its processor's
    pixel_values and image_grid_thw (and the mm_token_type_ids its Qwen3VLProcessor returns)."""
    input_ids = torch.tensor([ids])
    kwargs = {}
    if pictures:
        processed = reference_processor()(images=pictures, return_tensors="pt")
        kwargs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"],
                  "mm_token_type_ids": (input_ids == image_token_id).int()}
    with torch.no_grad():
        out = hf_model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[0, len(ids):].tolist(), [torch.log_softmax(step[0].float(), -1) for step in out.logits]
