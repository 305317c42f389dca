"""Qwen3.5/3.6's mmproj (`clip.projector_type` qwen3vl_merger, as llama.cpp's converter writes it for a
Qwen3_5(Moe)ForConditionalGeneration) read into models/vision/qwen3_5_vision.py's `QwenVision`.

What the converter changed, undone here: the checkpoint's Conv3d patch embedding (kernel temporal x patch x
patch) is stored as two 2D kernels, `v.patch_embd.weight` (frame 0) and `v.patch_embd.weight.1` (frame 1),
stacked back along the temporal axis; the merger's LayerNorm is `v.post_ln`, its two linears `mm.0` and `mm.2`.
The fused `attn_qkv` and every other tensor keep transformers' layout. The file keeps neither the rotary base
(the released checkpoints' 10,000, llama.cpp's too) nor the processor's pixel bounds: a picture is resized as
llama.cpp's mtmd does for this projector, to between 8 and 4096 image tokens (its `set_limit_image_tokens(8,
4096)`), with the processor's bicubic filter and the file's mean and std. Qwen3-VL's deepstack layers are
not served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from localserve.loading.mmproj import (
    MmprojError,
    MmprojFile,
    MmprojTensor,
    block_target,
    image_token_ids,
    load_mmproj_weights,
    mmproj_tensors,
)
from localserve.models.config import ModelConfig
from localserve.models.vision.adapter import ImageEncoder
from localserve.models.vision.preprocess import ImageProcessing
from localserve.models.vision.qwen3_5_vision import QwenVision, QwenVisionConfig
from localserve.models.vision.qwen_preprocess import DEFAULT_RESAMPLE, QwenImageProcessing

MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 8, 4096  # llama.cpp's bounds for the qwen*vl projectors
TEMPORAL_PATCH_SIZE = 2  # the two frames of the converter's split patch embedding (the only size it writes)
# Qwen3.5's vision tokens, found by their text in the language model's vocabulary
QWEN_IMAGE_TOKENS = {"image": "<|image_pad|>", "video": "<|video_pad|>", "start": "<|vision_start|>",
                     "end": "<|vision_end|>"}
LAYER = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ffn_up": "mlp.linear_fc1",
         "ffn_down": "mlp.linear_fc2"}
FIXED = {"v.position_embd.weight": "pos_embed.weight", "v.patch_embd.bias": "patch_embed.proj.bias",
         "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
         "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
         "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias"}
PATCH_FRAMES = ("v.patch_embd.weight", "v.patch_embd.weight.1")


def qwen_target(name: str) -> str | None:
    """An mmproj tensor's name in QwenVision (None: not one of Qwen3.5's; the patch halves are combined apart)."""
    return block_target(name, FIXED, LAYER, "blocks")


def qwen_mmproj_config(mmproj: MmprojFile, token_ids: dict[str, int]) -> QwenVisionConfig:
    """QwenVision's config from `clip.vision.*` and the patch tensors; `token_ids` (image, video, start, end) from
    the language model's vocabulary."""
    if any(mmproj.value("clip.vision.is_deepstack_layers") or []):
        raise MmprojError(f"{mmproj.path}: clip.vision.is_deepstack_layers: deepstack layers (Qwen3-VL) are not "
                          f"served; Qwen3.5's mmproj has none")
    if mmproj.value("clip.use_gelu") is not True:
        raise MmprojError(f"{mmproj.path}: clip.use_gelu is not true: Qwen3.5's vision activation is gelu (tanh)")
    shapes = {name: shape for name, shape, _ in mmproj_tensors(mmproj) if name in (*PATCH_FRAMES,
                                                                                  "v.position_embd.weight")}
    for name in (*PATCH_FRAMES, "v.position_embd.weight"):
        if name not in shapes:
            raise MmprojError(f"{mmproj.path}: missing tensor {name}")
    hidden, heads = mmproj.positive_int("clip.vision.embedding_length"), mmproj.positive_int(
        "clip.vision.attention.head_count")
    if hidden % heads or (hidden // heads) % 4:
        raise MmprojError(f"{mmproj.path}: clip.vision.embedding_length {hidden} / clip.vision.attention.head_count "
                          f"{heads} must be a whole head size divisible by 4 (2D rotary)")
    positions = shapes["v.position_embd.weight"][0]
    side = round(positions ** 0.5)
    if side * side != positions:
        raise MmprojError(f"{mmproj.path}: v.position_embd.weight has {positions} rows, not a square table")
    patch_shape = shapes["v.patch_embd.weight"]
    if len(patch_shape) != 4:
        raise MmprojError(f"{mmproj.path}: v.patch_embd.weight has shape {list(patch_shape)}; a 2D convolution's "
                          f"[width, channels, patch, patch] expected")
    return QwenVisionConfig(
        depth=mmproj.positive_int("clip.vision.block_count"), hidden_size=hidden,
        intermediate_size=mmproj.positive_int("clip.vision.feed_forward_length"), num_heads=heads,
        in_channels=patch_shape[1], patch_size=mmproj.positive_int("clip.vision.patch_size"),
        temporal_patch_size=TEMPORAL_PATCH_SIZE, spatial_merge_size=int(mmproj.value("clip.vision.spatial_merge_size",
                                                                                     2)),
        out_hidden_size=mmproj.positive_int("clip.vision.projection_dim"), num_position_embeddings=positions,
        gelu_approximate="tanh", image_token_id=token_ids["image"], video_token_id=token_ids["video"],
        vision_start_token_id=token_ids["start"], vision_end_token_id=token_ids["end"])


def qwen_mmproj_processing(mmproj: MmprojFile, config: QwenVisionConfig) -> QwenImageProcessing:
    """llama.cpp's pixel bounds for the projector (module docstring), the file's mean and std."""
    mean, std = mmproj.channel_values("clip.vision.image_mean"), mmproj.channel_values("clip.vision.image_std")
    if 0.0 in std:
        raise MmprojError(f"{mmproj.path}: clip.vision.image_std {list(std)} has a zero")
    token_pixels = (config.patch_size * config.spatial_merge_size) ** 2
    return QwenImageProcessing(patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
                               merge_size=config.spatial_merge_size, min_pixels=MIN_IMAGE_TOKENS * token_pixels,
                               max_pixels=MAX_IMAGE_TOKENS * token_pixels,
                               pixels=ImageProcessing(height=0, width=0, resample=DEFAULT_RESAMPLE, mean=mean,
                                                      std=std))


def qwen_tensors(mmproj: MmprojFile) -> Iterator[tuple[str, str | None, tuple[int, ...], object]]:
    """The file's tensors under QwenVision's names, the two patch frames as one Conv3d kernel."""
    frames: dict[str, MmprojTensor] = {}
    for name, shape, read in mmproj_tensors(mmproj):
        if name not in PATCH_FRAMES:
            yield name, qwen_target(name), shape, read
            continue
        frames[name] = (name, shape, read)
        if len(frames) == 2:
            (_, first, read_first), (_, second, read_second) = frames[PATCH_FRAMES[0]], frames[PATCH_FRAMES[1]]
            if first != second:
                raise MmprojError(f"{mmproj.path}: {PATCH_FRAMES[0]} {list(first)} and {PATCH_FRAMES[1]} "
                                  f"{list(second)} differ in shape")
            yield (f"{PATCH_FRAMES[0]} and {PATCH_FRAMES[1]}", "patch_embed.proj.weight",
                   (first[0], first[1], TEMPORAL_PATCH_SIZE, *first[2:]),
                   lambda read_first=read_first, read_second=read_second: torch.stack(
                       (read_first(), read_second()), dim=2))


def load_mmproj_qwen_vision(mmproj: MmprojFile, token_ids: dict[str, int], dtype: torch.dtype = torch.float32,
                            device: torch.device | str = "cpu") -> QwenVision:
    """Qwen3.5's vision transformer and merger from a `qwen3vl_merger` mmproj, with its processing."""
    config = qwen_mmproj_config(mmproj, token_ids)
    with torch.device("meta"):
        model = QwenVision(config, qwen_mmproj_processing(mmproj, config)).to(dtype=dtype)
    model.to_empty(device=device)
    load_mmproj_weights(model, mmproj, qwen_tensors(mmproj))
    return model.eval()


def qwen_mmproj_encoder(mmproj: MmprojFile, model: Path, config: ModelConfig, vocabulary: dict[str, int],
                        dtype: torch.dtype, device: torch.device | str) -> ImageEncoder:
    """Qwen3.5's image encoder (models/vision/qwen3_5_encoder.py) over the mmproj's QwenVision, the vision
    tokens those of the language model's vocabulary."""
    from localserve.models.vision.qwen3_5_encoder import QwenImageEncoder

    ids = image_token_ids(vocabulary, QWEN_IMAGE_TOKENS, str(model))
    return QwenImageEncoder(load_mmproj_qwen_vision(mmproj, ids, dtype, device), marker=QWEN_IMAGE_TOKENS["image"])
