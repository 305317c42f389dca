"""Pixtral's vision transformer as transformers' PixtralVisionModel computes it, and the config of Mistral 3's
vision side (a Mistral3ForConditionalGeneration `config.json`: its `vision_config`, projector fields and image
token).

A picture of any size whose sides are multiples of the patch size (models/vision/pixtral_preprocess.py) is
cut into patches by a strided convolution without bias (row by row), RMS-normalised (`ln_pre`), then runs
`num_hidden_layers` pre-RMSNorm blocks: attention without biases over the patches of the same picture only
(several pictures go through at once, each attending to itself: transformers' block-diagonal mask), turned
by a 2D rotary embedding, and a gated MLP. No learned position table: a patch's place is in its rotation.
The rotary embedding: the head's `head_dim / 2` frequencies 1 / theta^(2i / head_dim) are split by parity,
the even ones turning with the patch's row and the odd ones with its column; the angles [rows' | columns']
repeat for both halves of the head (rotate-half pairs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from localserve.models.layers.norms import RMSNorm
from localserve.models.vision.config import VisionConfigError
from localserve.models.vision.qwen3_5_vision import (  # Qwen3.5's tower reads and rotates the same way
    DEFAULT_ROPE_THETA,
    _positive_int,
    _rope_theta,
    _rotate_half,
)
from torch import nn
from torch.nn import functional as F

# transformers' PixtralVisionConfig defaults (save_pretrained leaves out a field equal to its default)
PIXTRAL_DEFAULTS: dict[str, Any] = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                                    "num_attention_heads": 16, "num_channels": 3, "image_size": 1024,
                                    "patch_size": 16, "hidden_act": "gelu"}
# Mistral3Config's own fields
MISTRAL3_DEFAULTS: dict[str, Any] = {"image_token_index": 10, "projector_hidden_act": "gelu",
                                     "vision_feature_layer": -1, "multimodal_projector_bias": False,
                                     "spatial_merge_size": 2}
# the text config's rms_norm_eps (the projector's norm takes it) where it leaves it out, by its model_type
TEXT_NORM_EPS = {"mistral": 1e-6, "ministral3": 1e-5, "ministral": 1e-6}
MISTRAL3_TEXT_HIDDEN_SIZE = 5120  # Mistral3Config's text default (Mistral Small 3.1)
NORM_EPS = 1e-5  # fixed in transformers' Pixtral layers
# activations by the names configs give them -> a function
ACTIVATION_FUNCTIONS = {"gelu": F.gelu, "silu": F.silu, "swish": F.silu,
                        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                        "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(frozen=True)
class PixtralConfig:
    """The vision transformer's sizes; `image_size` is the longest side it was made for (the processor's
    bound where the folder has no processor config)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    num_channels: int = 3
    hidden_act: str = "gelu"
    rope_theta: float = DEFAULT_ROPE_THETA

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class Mistral3VisionConfig:
    """Mistral 3's eyes: the tower, which of its hidden states the projector takes (`feature_layer`, an index
    into [ln_pre's output, each layer's output] as Python counts), the projector (RMSNorm of eps
    `norm_eps`, spatial_merge_size^2 patches merged, Linear, activation, Linear) into the language model's
    `text_hidden_size`, and the image token's id."""

    vision: PixtralConfig
    text_hidden_size: int
    spatial_merge_size: int
    feature_layer: int
    projector_act: str
    projector_bias: bool
    norm_eps: float
    image_token_id: int

    @property
    def token_pixels(self) -> int:
        """The side in pixels of the square one image token covers: patch_size x spatial_merge_size."""
        return self.vision.patch_size * self.spatial_merge_size

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of image tokens of a picture of height x width pixels (multiples of token_pixels)."""
        return height // self.token_pixels, width // self.token_pixels


def _activation(name: Any, field: str, where: str) -> str:
    if name not in ACTIVATION_FUNCTIONS:
        raise VisionConfigError(f"{where}.{field} {name!r} is not supported; supported: "
                                f"{', '.join(ACTIVATION_FUNCTIONS)}")
    return name


def pixtral_config(vision: Any, where: str) -> PixtralConfig:
    """The tower's config from a `vision_config` dict (`where` names it in errors), transformers' defaults for
    the fields it leaves out."""
    if not isinstance(vision, dict):
        raise VisionConfigError(f"{where} must be an object; got {type(vision).__name__}")
    model_type = vision.get("model_type", "pixtral")
    if model_type != "pixtral":
        raise VisionConfigError(f"{where}.model_type {model_type!r} is not served; only pixtral is")
    fields = PIXTRAL_DEFAULTS | {key: value for key, value in vision.items() if key in PIXTRAL_DEFAULTS}
    sizes = {name: _positive_int(fields, name, where) for name in PIXTRAL_DEFAULTS if name != "hidden_act"}
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    if hidden % heads or (hidden // heads) % 4:
        raise VisionConfigError(f"{where}: hidden_size {hidden} / num_attention_heads {heads} must be a whole head "
                                f"size divisible by 4 (2D rotary: a quarter of the head per axis and half)")
    head_dim = vision.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise VisionConfigError(f"{where}.head_dim {head_dim!r} differs from hidden_size / num_attention_heads "
                                f"{hidden // heads} (transformers' attention takes the latter, its rotary the former)")
    return PixtralConfig(hidden_size=hidden, intermediate_size=sizes["intermediate_size"],
                         num_layers=sizes["num_hidden_layers"], num_heads=heads, patch_size=sizes["patch_size"],
                         image_size=sizes["image_size"], num_channels=sizes["num_channels"],
                         hidden_act=_activation(fields["hidden_act"], "hidden_act", where),
                         rope_theta=_rope_theta(vision, where))


def mistral3_vision_config(config: dict[str, Any], source: str) -> Mistral3VisionConfig:
    """The vision side of a Mistral3ForConditionalGeneration `config.json` (`source` names it in errors)."""
    vision = config.get("vision_config")
    if vision is None:
        raise VisionConfigError(f"{source}: no vision_config (a text-only checkpoint has no vision tower)")
    tower = pixtral_config(vision, f"{source}: vision_config")
    fields = MISTRAL3_DEFAULTS | {key: value for key, value in config.items() if key in MISTRAL3_DEFAULTS}
    layer = fields["vision_feature_layer"]
    layers = tower.num_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not -(layers + 1) <= layer <= layers:
        raise VisionConfigError(f"{source}: vision_feature_layer {layer!r} must be one layer's index in "
                                f"[{-(tower.num_layers + 1)}, {tower.num_layers}] (a list of layers is not served)")
    bias = fields["multimodal_projector_bias"]
    if not isinstance(bias, bool):
        raise VisionConfigError(f"{source}: multimodal_projector_bias must be true or false; got {bias!r}")
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise VisionConfigError(f"{source}: text_config must be an object; got {type(text).__name__}")
    text_hidden = _positive_int({"hidden_size": MISTRAL3_TEXT_HIDDEN_SIZE} | text, "hidden_size",
                                f"{source}: text_config")
    eps = text.get("rms_norm_eps", TEXT_NORM_EPS.get(text.get("model_type", "mistral"), 1e-6))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise VisionConfigError(f"{source}: text_config.rms_norm_eps must be a number in (0, 1); got {eps!r}")
    return Mistral3VisionConfig(vision=tower, text_hidden_size=text_hidden,
                                spatial_merge_size=_positive_int(fields, "spatial_merge_size", source),
                                feature_layer=layer,
                                projector_act=_activation(fields["projector_hidden_act"], "projector_hidden_act",
                                                          source),
                                projector_bias=bias, norm_eps=float(eps),
                                image_token_id=_positive_int(fields, "image_token_index", source))


class PixtralAttention(nn.Module):
    """Multi-head attention of each picture's patches over its own, rotated by the 2D rotary embedding."""

    def __init__(self, config: PixtralConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        patches = hidden.shape[0]

        def heads(projection: nn.Linear) -> torch.Tensor:  # [heads, patches, head_dim]
            return projection(hidden).view(patches, self.num_heads, self.head_dim).transpose(0, 1)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        outputs = [F.scaled_dot_product_attention(q_one, k_one, v_one, scale=self.head_dim ** -0.5)
                   for q_one, k_one, v_one in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))]
        return self.o_proj(torch.cat(outputs, dim=1).transpose(0, 1).reshape(patches, -1))


class PixtralMLP(nn.Module):
    """down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, config: PixtralConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATION_FUNCTIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(hidden)) * self.up_proj(hidden))


class PixtralLayer(nn.Module):
    """x + attention(attention_norm(x)), then + feed_forward(ffn_norm(.))."""

    def __init__(self, config: PixtralConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, NORM_EPS)
        self.attention = PixtralAttention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, NORM_EPS)
        self.feed_forward = PixtralMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        hidden = hidden + self.attention(self.attention_norm(hidden), cos, sin, lengths)
        return hidden + self.feed_forward(self.ffn_norm(hidden))


class PixtralTransformer(nn.Module):
    def __init__(self, config: PixtralConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(config) for _ in range(config.num_layers))


class PixtralVisionTower(nn.Module):
    """Pictures [channels, height, width] (sides multiples of patch_size; any sizes) -> the hidden states the
    projector takes, [all pictures' patches, hidden] (each picture's patches row by row, pictures in order)."""

    def __init__(self, config: PixtralConfig, feature_layer: int = -1) -> None:
        super().__init__()
        self.config = config
        self.feature_layer = feature_layer % (config.num_layers + 1)  # 0: ln_pre's output, i: layer i's
        self.patch_conv = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                    stride=config.patch_size, bias=False)
        self.ln_pre = RMSNorm(config.hidden_size, NORM_EPS)
        self.transformer = PixtralTransformer(config)

    def rotary(self, grids: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [patches, head_dim] (float32) of each picture's patches, for patch grids (rows, cols)."""
        head_dim = self.config.head_dim
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
        angles = []
        for rows, cols in grids:
            row, col = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device),
                                      indexing="ij")
            angles.append(torch.cat((row.reshape(-1, 1) * inv_freq[0::2], col.reshape(-1, 1) * inv_freq[1::2]),
                                    dim=-1))
        angle = torch.cat(angles).repeat(1, 2)
        return angle.cos(), angle.sin()

    def forward(self, pictures: list[torch.Tensor]) -> torch.Tensor:
        patch = self.config.patch_size
        grids = [(picture.shape[-2] // patch, picture.shape[-1] // patch) for picture in pictures]
        hidden = torch.cat([self.patch_conv(picture[None])[0].flatten(1).t() for picture in pictures])
        hidden = self.ln_pre(hidden)
        cos, sin = self.rotary(grids, hidden.device)
        cos, sin = cos.to(hidden.dtype)[None], sin.to(hidden.dtype)[None]
        lengths = [rows * cols for rows, cols in grids]
        for layer in self.transformer.layers[:self.feature_layer]:
            hidden = layer(hidden, cos, sin, lengths)
        return hidden
