"""Mistral 3's mmproj (Mistral Small 3.1 / 3.2: `clip.projector_type` pixtral, as llama.cpp's converter writes
it for a Mistral3ForConditionalGeneration) read into models/vision/mistral3_vision.py's `Mistral3Vision`, and
its image encoder (models/vision/mistral3_encoder.py) for a GGUF pair.

What the file holds: the Pixtral tower's shape under `clip.vision.*`, its activation as `clip.use_silu` or
`clip.use_gelu`, the merge of the projector as `clip.vision.spatial_merge_size`, the rotary base as
`clip.rope.freq_base` (written from Mistral's own format only; transformers' 10,000 otherwise), the
normalisation's eps as `clip.vision.attention.layer_norm_epsilon` (float32 values, this one and the image
mean and std, are read as the shortest decimal of the same float32: 1e-05 rather than 9.9999997e-06; llama.cpp
takes the eps for the projector's norm too, where transformers takes the text config's, the same 1e-5 in
Mistral Small 3.x), the projector as `mm.input_norm`, `mm.patch_merger`, `mm.1`, `mm.2` (biases where it has
them). What the converter changed,
undone here: the tower's q and k projections are permuted the llama way (llama.cpp's rotary pairs adjacent
values; transformers' pairs the halves), undone with loading/pieces.py's `unpermute_rotary`.

The row break's embedding (the language model's input embedding of `[IMG_BREAK]`, which the span carries
between rows) is the file's `v.token_embd.img_break` where it has one (files converted from Mistral's format
or by earlier converters); llama.cpp's converter of this version drops it for a transformers checkpoint (the
language model's tensors are filtered out before it is taken), so otherwise it is read from the pair's
language model .gguf: row `[IMG_BREAK]` of `token_embd.weight`, de-quantized alone.

Not kept in the file, so taken as Mistral 3 has them: the projector's activation (gelu), the feature layer
(the last), the image processing's filter (bicubic); the bound of a picture's longer side is the tower's
`clip.vision.image_size` (Mistral Small 3.1's processor bound equals it). Pixtral 12B's mmproj (no patch
merger: LlavaForConditionalGeneration) is refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from localserve.loading.gguf import GGUFLoadError, open_gguf
from localserve.loading.mmproj import (
    MmprojError,
    MmprojFile,
    block_target,
    image_token_ids,
    load_mmproj_weights,
    mmproj_tensors,
    tensor_shape,
)
from localserve.loading.pieces import unpermute_rotary
from localserve.models.config import ModelConfig
from localserve.models.vision.adapter import ImageEncoder
from localserve.models.vision.config import VisionConfigError
from localserve.models.vision.mistral3_vision import Mistral3Vision
from localserve.models.vision.pixtral import DEFAULT_ROPE_THETA, Mistral3VisionConfig, PixtralConfig
from localserve.models.vision.pixtral_preprocess import PixtralImageProcessing, pixtral_image_processing

PROJECTOR_ACT = "gelu"  # Mistral3Config's projector_hidden_act, which the file does not keep
BREAK_TENSOR = "v.token_embd.img_break"
EMBEDDING_TENSOR = "token_embd.weight"  # the language model's input embeddings in its .gguf
# Pixtral's image tokens, found by their text in the language model's vocabulary
PIXTRAL_IMAGE_TOKENS = {"image": "[IMG]", "break": "[IMG_BREAK]", "end": "[IMG_END]"}
LAYER = {"attn_q": "attention.q_proj", "attn_k": "attention.k_proj", "attn_v": "attention.v_proj",
         "attn_out": "attention.o_proj", "ln1": "attention_norm", "ln2": "ffn_norm",
         "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj"}
FIXED = {"v.patch_embd.weight": "vision_tower.patch_conv.weight", "v.pre_ln.weight": "vision_tower.ln_pre.weight",
         "mm.input_norm.weight": "multi_modal_projector.norm.weight",
         "mm.patch_merger.weight": "multi_modal_projector.patch_merger.merging_layer.weight",
         "mm.1.weight": "multi_modal_projector.linear_1.weight", "mm.1.bias": "multi_modal_projector.linear_1.bias",
         "mm.2.weight": "multi_modal_projector.linear_2.weight", "mm.2.bias": "multi_modal_projector.linear_2.bias"}
ROTATED = ("attn_q", "attn_k")  # permuted the llama way by the converter


def pixtral_target(name: str) -> str | None:
    """An mmproj tensor's name in Mistral3Vision (None: not one of Mistral 3's)."""
    return block_target(name, FIXED, LAYER, "vision_tower.transformer.layers")


def _activation(mmproj: MmprojFile) -> str:
    silu, gelu = mmproj.value("clip.use_silu") is True, mmproj.value("clip.use_gelu") is True
    if silu == gelu:
        raise MmprojError(f"{mmproj.path}: clip.use_silu and clip.use_gelu must name one activation of the tower; "
                          f"got use_silu={mmproj.value('clip.use_silu')!r}, use_gelu={mmproj.value('clip.use_gelu')!r}")
    return "silu" if silu else "gelu"


def _float32_value(mmproj: MmprojFile, key: str, default: float, low: float, high: float) -> float:
    value = mmproj.value(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
        raise MmprojError(f"{mmproj.path}: {key} must be a number in ({low:g}, {high:g}); got {value!r}")
    return float32_decimal(value)


def float32_decimal(value: float) -> float:
    """The shortest decimal of the float32 the file holds (0.4 for 0.4000000059604645): the value as the
    checkpoint's config wrote it."""
    return float(str(np.float32(value)))


def pixtral_mmproj_config(mmproj: MmprojFile, image_token_id: int) -> Mistral3VisionConfig:
    """Mistral3Vision's config from `clip.*` and the patch tensors (module docstring); `image_token_id` is
    `[IMG]`'s in the language model's vocabulary."""
    for name in ("mm.patch_merger.weight", "v.patch_embd.weight", "mm.1.weight"):
        tensor_shape(mmproj, name)  # MmprojError names a missing one
    if mmproj.value("clip.vision.spatial_merge_size") is None:
        raise MmprojError(f"{mmproj.path}: missing key clip.vision.spatial_merge_size (Mistral 3's patch merger; "
                          f"Pixtral 12B's projector without one is not served)")
    hidden, heads = mmproj.positive_int("clip.vision.embedding_length"), mmproj.positive_int(
        "clip.vision.attention.head_count")
    if hidden % heads or (hidden // heads) % 4:
        raise MmprojError(f"{mmproj.path}: clip.vision.embedding_length {hidden} / clip.vision.attention.head_count "
                          f"{heads} must be a whole head size divisible by 4 (2D rotary)")
    patch_shape = tensor_shape(mmproj, "v.patch_embd.weight")
    if len(patch_shape) != 4:
        raise MmprojError(f"{mmproj.path}: v.patch_embd.weight has shape {list(patch_shape)}; a convolution's "
                          f"[width, channels, patch, patch] expected")
    tower = PixtralConfig(hidden_size=hidden, intermediate_size=mmproj.positive_int("clip.vision.feed_forward_length"),
                          num_layers=mmproj.positive_int("clip.vision.block_count"), num_heads=heads,
                          patch_size=mmproj.positive_int("clip.vision.patch_size"),
                          image_size=mmproj.positive_int("clip.vision.image_size"), num_channels=patch_shape[1],
                          hidden_act=_activation(mmproj),
                          rope_theta=_float32_value(mmproj, "clip.rope.freq_base", DEFAULT_ROPE_THETA, 0, np.inf))
    return Mistral3VisionConfig(
        vision=tower, text_hidden_size=mmproj.positive_int("clip.vision.projection_dim"),
        spatial_merge_size=mmproj.positive_int("clip.vision.spatial_merge_size"), feature_layer=-1,
        projector_act=PROJECTOR_ACT, projector_bias=any(t.name == "mm.1.bias" for t in mmproj.reader.tensors),
        norm_eps=_float32_value(mmproj, "clip.vision.attention.layer_norm_epsilon", 1e-5, 0, 1),
        image_token_id=image_token_id)


def pixtral_mmproj_processing(mmproj: MmprojFile, config: Mistral3VisionConfig) -> PixtralImageProcessing:
    """PixtralImageProcessor's steps with the file's mean and std, the longer side bounded by the tower's
    image_size."""
    mean, std = (mmproj.channel_values(f"clip.vision.image_{name}") for name in ("mean", "std"))
    vision = config.vision
    try:
        return pixtral_image_processing({"image_mean": [float32_decimal(v) for v in mean],
                                         "image_std": [float32_decimal(v) for v in std]}, vision.patch_size,
                                        config.spatial_merge_size, vision.image_size, str(mmproj.path))
    except VisionConfigError as exc:
        raise MmprojError(str(exc)) from None


def pixtral_tensors(mmproj: MmprojFile, num_heads: int):
    """The file's tensors under Mistral3Vision's names (the row break's left out), q and k un-permuted."""
    for name, shape, read in mmproj_tensors(mmproj):
        if name == BREAK_TENSOR:
            continue
        if name.split(".")[-2] in ROTATED:
            if shape[0] % (2 * num_heads):
                raise MmprojError(f"{mmproj.path}: {name} has {shape[0]} rows, not a multiple of 2 x "
                                  f"{num_heads} heads")
            yield name, pixtral_target(name), shape, lambda read=read: unpermute_rotary(read(), num_heads)
        else:
            yield name, pixtral_target(name), shape, read


def load_mmproj_mistral3_vision(mmproj: MmprojFile, image_token_id: int, dtype: torch.dtype = torch.float32,
                                device: torch.device | str = "cpu") -> Mistral3Vision:
    """The Pixtral tower and Mistral 3's projector from a `pixtral` mmproj, with its processing."""
    config = pixtral_mmproj_config(mmproj, image_token_id)
    with torch.device("meta"):
        model = Mistral3Vision(config, pixtral_mmproj_processing(mmproj, config)).to(dtype=dtype)
    model.to_empty(device=device)
    load_mmproj_weights(model, mmproj, pixtral_tensors(mmproj, config.vision.num_heads))
    return model.eval()


def _embedding_row(path: Path, token_id: int, hidden_size: int) -> torch.Tensor:
    """Row `token_id` of the language model's token_embd.weight [hidden] in float32, de-quantized alone."""
    import gguf

    try:
        reader = open_gguf(path)
    except GGUFLoadError as exc:
        raise MmprojError(str(exc)) from None
    except OSError as exc:
        raise MmprojError(f"{path}: cannot read the language model for the row break's embedding ({exc})") from None
    tensor = next((t for t in reader.tensors if t.name == EMBEDDING_TENSOR), None)
    if tensor is None:
        raise MmprojError(f"{path}: missing tensor {EMBEDDING_TENSOR} (the row break's embedding is read from it)")
    rows, width = int(tensor.shape[-1]), int(tensor.shape[0])
    if width != hidden_size or not 0 <= token_id < rows:
        raise MmprojError(f"{path}: {EMBEDDING_TENSOR} is [{rows}, {width}]; the row break token {token_id} of "
                          f"hidden size {hidden_size} is not in it")
    values = gguf.quants.dequantize(tensor.data[token_id:token_id + 1], tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(hidden_size)


def break_embedding(mmproj: MmprojFile, model: Path, token_id: int, hidden_size: int) -> torch.Tensor:
    """The row break's embedding [hidden] in float32: the mmproj's own, else the language model's (module
    docstring)."""
    found = next(((shape, read) for name, shape, read in mmproj_tensors(mmproj) if name == BREAK_TENSOR), None)
    if found is None:
        return _embedding_row(model, token_id, hidden_size)
    shape, read = found
    if [d for d in shape if d != 1] != [hidden_size]:
        raise MmprojError(f"{mmproj.path}: {BREAK_TENSOR} has shape {list(shape)}; the language model's hidden size "
                          f"is {hidden_size}")
    return read().reshape(hidden_size)


def pixtral_mmproj_encoder(mmproj: MmprojFile, model: Path, config: ModelConfig, vocabulary: dict[str, int],
                           dtype: torch.dtype, device: torch.device | str) -> ImageEncoder:
    """Mistral 3's image encoder over the mmproj's Mistral3Vision, the image tokens those of the language
    model's vocabulary, the row break's embedding as the module docstring says."""
    from localserve.models.vision.mistral3_encoder import Mistral3ImageEncoder, PixtralImageTokens

    ids = image_token_ids(vocabulary, PIXTRAL_IMAGE_TOKENS, str(model))
    vision = load_mmproj_mistral3_vision(mmproj, ids["image"], dtype, device)
    tokens = PixtralImageTokens(image=PIXTRAL_IMAGE_TOKENS["image"], image_id=ids["image"],
                                row_break=PIXTRAL_IMAGE_TOKENS["break"], row_break_id=ids["break"],
                                end=PIXTRAL_IMAGE_TOKENS["end"], end_id=ids["end"])
    row_break = break_embedding(mmproj, model, ids["break"], vision.config.text_hidden_size)
    return Mistral3ImageEncoder(vision, tokens, row_break.to(device=device, dtype=dtype))
