"""The vision parts of a multimodal config: SigLIP's tower (`vision_config`) and what Gemma 3's projector and
prompt need around it (`mm_tokens_per_image`, the image, begin- and end-of-image token ids). Plain data."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from localserve.models.config import ModelConfigError

# transformers' SiglipVisionConfig defaults: save_pretrained leaves out a field equal to its default
SIGLIP_DEFAULTS: dict[str, Any] = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                   "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
                                   "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
# the activations SigLIP checkpoints name -> torch's gelu `approximate` argument
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}
# transformers' Gemma3Config defaults (the released checkpoints' ids) and Gemma3TextConfig's hidden size
GEMMA3_DEFAULTS: dict[str, Any] = {"mm_tokens_per_image": 256, "image_token_index": 262_144,
                                   "boi_token_index": 255_999, "eoi_token_index": 256_000}
GEMMA3_TEXT_HIDDEN_SIZE = 2304


class VisionConfigError(ModelConfigError):
    """A vision config this project cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class SiglipConfig:
    """SigLIP's vision transformer: square images of `image_size` pixels cut into `patch_size` patches."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    gelu_approximate: str = "tanh"  # torch's `approximate`: "tanh" (gelu_pytorch_tanh) or "none"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """Gemma 3's tower, projector and image tokens: each image becomes `mm_tokens_per_image` embeddings of
    the language model's `text_hidden_size`, placed where the prompt holds `image_token_id` between
    `boi_token_id` and `eoi_token_id`."""

    vision: SiglipConfig
    mm_tokens_per_image: int
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    def placeholder_ids(self) -> list[int]:
        """One image's tokens in the prompt: begin-of-image, `mm_tokens_per_image` image tokens (their input
        embeddings come from the encoder), end-of-image. Gemma3Processor writes them, with a blank line
        ("\\n\\n") before and after, in place of each begin-of-image token the chat template emits."""
        return [self.boi_token_id, *[self.image_token_id] * self.mm_tokens_per_image, self.eoi_token_id]

    @property
    def pool_kernel(self) -> int:
        """The side of the square of patches averaged into one image token."""
        return self.vision.patches_per_side // self.tokens_per_side


def _positive_int(section: dict[str, Any], field: str, where: str) -> int:
    value = section[field]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise VisionConfigError(f"{where}.{field} must be a positive integer; got {value!r}")
    return value


def _square_side(section: dict[str, Any], field: str, where: str) -> int:
    """`image_size` / `patch_size`: an int, or [height, width] with both equal (SigLIP's are square)."""
    value = section[field]
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise VisionConfigError(f"{where}.{field} must be square (one int, or [n, n]); got {value!r}")
        section = {field: value[0]}
    return _positive_int(section, field, where)


def siglip_config(vision: dict[str, Any], where: str) -> SiglipConfig:
    """SigLIP's config from a `vision_config` dict (`where` names it in errors: "<file>: vision_config"),
    transformers' defaults for the fields it leaves out."""
    if not isinstance(vision, dict):
        raise VisionConfigError(f"{where} must be an object; got {type(vision).__name__}")
    model_type = vision.get("model_type", "siglip_vision_model")
    if model_type != "siglip_vision_model":
        raise VisionConfigError(f"{where}.model_type {model_type!r} is not served; only siglip_vision_model is")
    fields = SIGLIP_DEFAULTS | {key: value for key, value in vision.items() if key in SIGLIP_DEFAULTS}
    sizes = {name: _positive_int(fields, name, where) for name in
             ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels")}
    image_size, patch_size = _square_side(fields, "image_size", where), _square_side(fields, "patch_size", where)
    if sizes["hidden_size"] % sizes["num_attention_heads"]:
        raise VisionConfigError(f"{where}: hidden_size {sizes['hidden_size']} is not a multiple of "
                                f"num_attention_heads {sizes['num_attention_heads']}")
    if image_size % patch_size:
        raise VisionConfigError(f"{where}: image_size {image_size} is not a multiple of patch_size {patch_size}")
    activation = fields["hidden_act"]
    if activation not in ACTIVATIONS:
        raise VisionConfigError(f"{where}.hidden_act {activation!r} is not supported; supported: "
                                f"{', '.join(ACTIVATIONS)}")
    eps = fields["layer_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise VisionConfigError(f"{where}.layer_norm_eps must be a number in (0, 1); got {eps!r}")
    return SiglipConfig(hidden_size=sizes["hidden_size"], intermediate_size=sizes["intermediate_size"],
                        num_layers=sizes["num_hidden_layers"], num_heads=sizes["num_attention_heads"],
                        image_size=image_size, patch_size=patch_size, num_channels=sizes["num_channels"],
                        layer_norm_eps=float(eps), gelu_approximate=ACTIVATIONS[activation])


def gemma3_vision_config(config: dict[str, Any], source: str) -> Gemma3VisionConfig:
    """The vision side of a Gemma3ForConditionalGeneration `config.json` (`source` names it in errors)."""
    vision = config.get("vision_config")
    if vision is None:
        raise VisionConfigError(f"{source}: no vision_config (a text-only checkpoint has no vision tower)")
    siglip = siglip_config(vision, f"{source}: vision_config")
    fields = GEMMA3_DEFAULTS | {key: value for key, value in config.items() if key in GEMMA3_DEFAULTS}
    ids = {name: _positive_int(fields, name, source) for name in GEMMA3_DEFAULTS}
    tokens = ids["mm_tokens_per_image"]
    side = math.isqrt(tokens)
    if side * side != tokens or siglip.patches_per_side % side:
        raise VisionConfigError(f"{source}: mm_tokens_per_image {tokens} must be a square whose side divides the "
                                f"{siglip.patches_per_side} patches per side (image_size {siglip.image_size} / "
                                f"patch_size {siglip.patch_size})")
    text = config.get("text_config") or {}
    text_hidden = _positive_int({"hidden_size": GEMMA3_TEXT_HIDDEN_SIZE} | text, "hidden_size",
                                f"{source}: text_config")
    return Gemma3VisionConfig(vision=siglip, mm_tokens_per_image=tokens, text_hidden_size=text_hidden,
                              image_token_id=ids["image_token_index"], boi_token_id=ids["boi_token_index"],
                              eoi_token_id=ids["eoi_token_index"])
