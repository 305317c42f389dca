"""Qwen3.5/3.6's vision transformer (transformers' Qwen3_5VisionModel, the same in Qwen3_5MoeVisionModel), its
config, where a Qwen3_5ForConditionalGeneration checkpoint's `model.visual.*` tensors go, and the 3D
(mRoPE) positions the language model gives an image's tokens.

An image arrives as rows of flattened patches (models/vision/qwen_preprocess.py), each row one patch of
channels x temporal_patch_size x patch_size^2 values, the rows in merge-block order: the grid_h x grid_w
patches are walked in blocks of spatial_merge_size^2 neighbours (block by block row-major, and row-major
inside a block). The encoder:
- embeds each row linearly (the checkpoint's Conv3d whose kernel is the whole patch),
- adds a learned position embedding: the square table of num_position_embeddings entries is resized to the
  image's grid_h x grid_w by bilinear interpolation with aligned corners,
- runs `depth` pre-LayerNorm blocks whose attention sees only the patches of the same frame (an image is one
  frame), with a 2D rotary embedding: the first half of each head's rotated pair turns with the patch's row,
  the second half with its column,
- merges each block of spatial_merge_size^2 patches into one token: LayerNorm per patch, concatenated, then
  Linear, exact GELU, Linear to out_hidden_size (the language model's hidden size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from localserve.models.vision.config import ACTIVATIONS, VisionConfigError
from torch import nn
from torch.nn import functional as F

# transformers' Qwen3_5VisionConfig defaults (save_pretrained leaves out a field equal to its default)
QWEN_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304}
# Qwen3_5Config's token ids (the released checkpoints')
QWEN_TOKEN_DEFAULTS: dict[str, int] = {"image_token_id": 248_056, "video_token_id": 248_057,
                                       "vision_start_token_id": 248_053, "vision_end_token_id": 248_054}
VISION_MODEL_TYPES = ("qwen3_5_vision", "qwen3_5_moe_vision", "qwen3_5", "qwen3_5_moe")  # old saves: the parent's
DEFAULT_ROPE_THETA = 10_000.0
LAYER_NORM_EPS = 1e-6  # fixed in transformers' blocks and merger
PREFIXES = ("model.visual.", "visual.")


@dataclass(frozen=True)
class QwenVisionConfig:
    """The vision transformer's sizes and the prompt's vision token ids."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    gelu_approximate: str = "tanh"
    rope_theta: float = DEFAULT_ROPE_THETA
    image_token_id: int = QWEN_TOKEN_DEFAULTS["image_token_id"]
    video_token_id: int = QWEN_TOKEN_DEFAULTS["video_token_id"]
    vision_start_token_id: int = QWEN_TOKEN_DEFAULTS["vision_start_token_id"]
    vision_end_token_id: int = QWEN_TOKEN_DEFAULTS["vision_end_token_id"]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values in one flattened patch row: channels x temporal_patch_size x patch_size^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def position_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    def tokens_per_image(self, grid_thw: tuple[int, int, int]) -> int:
        """The language model's tokens for an image of `grid_thw` patches: t * h * w / spatial_merge_size^2."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size ** 2

    def placeholder_ids(self, grid_thw: tuple[int, int, int]) -> list[int]:
        """One image in the prompt as Qwen3VLProcessor writes it: vision start, one image token per merged
        token (their input embeddings come from the encoder), vision end."""
        return [self.vision_start_token_id, *[self.image_token_id] * self.tokens_per_image(grid_thw),
                self.vision_end_token_id]


def _positive_int(fields: dict[str, Any], name: str, where: str) -> int:
    value = fields[name]
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]  # patch_size may be written [n, n]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise VisionConfigError(f"{where}.{name} must be a positive integer; got {fields[name]!r}")
    return value


def _rope_theta(vision: dict[str, Any], where: str) -> float:
    rope = vision.get("rope_parameters") or vision.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise VisionConfigError(f"{where}.rope_parameters must be an object; got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "axial"))
    if kind not in ("axial", "default"):
        raise VisionConfigError(f"{where}.rope_parameters.rope_type {kind!r} is not supported; only axial is")
    theta = rope.get("rope_theta", vision.get("rope_theta", DEFAULT_ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise VisionConfigError(f"{where}.rope_theta must be a positive number; got {theta!r}")
    return float(theta)


def qwen_vision_config(config: dict[str, Any], source: str) -> QwenVisionConfig:
    """The vision side of a Qwen3_5(Moe)ForConditionalGeneration `config.json` (`source` names it in errors),
    transformers' defaults for the fields it leaves out."""
    vision = config.get("vision_config")
    if vision is None:
        raise VisionConfigError(f"{source}: no vision_config (a text-only checkpoint has no vision tower)")
    where = f"{source}: vision_config"
    if not isinstance(vision, dict):
        raise VisionConfigError(f"{where} must be an object; got {type(vision).__name__}")
    model_type = vision.get("model_type", "qwen3_5_vision")
    if model_type not in VISION_MODEL_TYPES:
        raise VisionConfigError(f"{where}.model_type {model_type!r} is not served; served: "
                                f"{', '.join(VISION_MODEL_TYPES)}")
    aliases = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}
    given = {aliases.get(key, key): value for key, value in vision.items()}
    fields = QWEN_VISION_DEFAULTS | {key: value for key, value in given.items() if key in QWEN_VISION_DEFAULTS}
    sizes = {name: _positive_int(fields, name, where) for name in QWEN_VISION_DEFAULTS if name != "hidden_act"}
    hidden, heads = sizes["hidden_size"], sizes["num_heads"]
    if hidden % heads or (hidden // heads) % 4:
        raise VisionConfigError(f"{where}: hidden_size {hidden} / num_heads {heads} must be a whole head size "
                                f"divisible by 4 (2D rotary: a quarter per axis and half)")
    side = math.isqrt(sizes["num_position_embeddings"])
    if side * side != sizes["num_position_embeddings"]:
        raise VisionConfigError(f"{where}.num_position_embeddings {sizes['num_position_embeddings']} must be a "
                                f"square (a side x side table of positions)")
    activation = fields["hidden_act"]
    if activation not in ACTIVATIONS:
        raise VisionConfigError(f"{where}.hidden_act {activation!r} is not supported; supported: "
                                f"{', '.join(ACTIVATIONS)}")
    ids = {name: _positive_int(QWEN_TOKEN_DEFAULTS | config, name, source) for name in QWEN_TOKEN_DEFAULTS}
    text = config.get("text_config") or {}
    if isinstance(text, dict) and "hidden_size" in text and text["hidden_size"] != sizes["out_hidden_size"]:
        raise VisionConfigError(f"{where}.out_hidden_size {sizes['out_hidden_size']} must equal "
                                f"text_config.hidden_size {text['hidden_size']} (image tokens are input embeddings)")
    return QwenVisionConfig(**sizes, gelu_approximate=ACTIVATIONS[activation], rope_theta=_rope_theta(vision, where),
                            **ids)


def merge_block_rows_cols(grid_h: int, grid_w: int, merge: int, device: torch.device | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, column) of each patch of a grid_h x grid_w frame in merge-block order (see the module)."""
    rows = torch.arange(grid_h, device=device).view(grid_h // merge, merge, 1, 1)
    cols = torch.arange(grid_w, device=device).view(1, 1, grid_w // merge, merge)
    shape = (grid_h // merge, grid_w // merge, merge, merge)  # block row, block col, in row, in col
    rows = rows.permute(0, 2, 1, 3).expand(shape)
    cols = cols.permute(0, 2, 1, 3).expand(shape)
    return rows.reshape(-1), cols.reshape(-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class QwenVisionAttention(nn.Module):
    """Multi-head attention over one frame's patches with the 2D rotary embedding; q, k, v in one projection."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        patches = hidden.shape[0]
        q, k, v = self.qkv(hidden).view(patches, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [patches, 1, head_dim], float32
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        outputs = []
        for q_frame, k_frame, v_frame in zip(*(x.transpose(0, 1).split(lengths, dim=1) for x in (q, k, v))):
            outputs.append(F.scaled_dot_product_attention(q_frame, k_frame, v_frame, scale=self.head_dim ** -0.5))
        return self.proj(torch.cat(outputs, dim=1).transpose(0, 1).reshape(patches, -1))


class QwenVisionMLP(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = config.gelu_approximate

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(hidden), approximate=self.approximate))


class QwenVisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.))."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = QwenVisionAttention(config)
        self.mlp = QwenVisionMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), cos, sin, lengths)
        return hidden + self.mlp(self.norm2(hidden))


class QwenPatchMerger(nn.Module):
    """spatial_merge_size^2 neighbouring patches -> one token of out_hidden_size."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        merged = self.norm(hidden).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(merged)))


class QwenPatchEmbed(nn.Module):
    """A flattened patch row -> hidden: the checkpoint's Conv3d (kernel = stride = the patch) as one matmul."""

    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.zeros(config.hidden_size, config.in_channels, *kernel))
        self.proj.bias = nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.proj.weight.flatten(1), self.proj.bias)


class QwenVision(nn.Module):
    """Qwen3.5/3.6's image encoder: flattened patches -> the language model's input embeddings of each image."""

    def __init__(self, config: QwenVisionConfig, processing: Any = None) -> None:
        super().__init__()
        self.config = config
        self.processing = processing  # a QwenImageProcessing (qwen_preprocess.py), set by the loader
        self.patch_embed = QwenPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(QwenVisionBlock(config) for _ in range(config.depth))
        self.merger = QwenPatchMerger(config)

    def _check(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
        config = self.config
        if pixel_values.dim() != 2 or pixel_values.shape[1] != config.patch_values:
            raise ValueError(f"encode: pixel_values must be [patches, {config.patch_values}]; "
                             f"got {list(pixel_values.shape)}")
        if not pixel_values.is_floating_point():
            raise ValueError(f"encode: pixel_values must be floating point; got {pixel_values.dtype}")
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
            raise ValueError(f"encode: grid_thw must be [images, 3] (t, h, w); got {list(grid_thw.shape)}")
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        merge = config.spatial_merge_size
        for index, (t, h, w) in enumerate(grids):
            if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
                raise ValueError(f"encode: grid_thw[{index}] = {[t, h, w]} must be positive with h and w "
                                 f"multiples of spatial_merge_size {merge}")
        patches = sum(t * h * w for t, h, w in grids)
        if patches != pixel_values.shape[0]:
            raise ValueError(f"encode: grid_thw gives {patches} patches; pixel_values has {pixel_values.shape[0]}")
        return grids

    def _positions(self, grids: list[tuple[int, int, int]], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each patch's interpolated position embedding (float32) and its rotary cos and sin."""
        side, merge = self.config.position_side, self.config.spatial_merge_size
        table = self.pos_embed.weight.float().t().reshape(1, -1, side, side)
        half = self.config.head_dim // 2  # rows turn a quarter of the head's pairs, columns another
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, half, 2, device=device).float() / half)
        embeddings, angles = [], []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
            rows, cols = merge_block_rows_cols(h, w, merge, device)
            embeddings.append(grid[:, rows, cols].t().repeat(t, 1))
            turn = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
            angles.append(turn.repeat(t, 1))
        angle = torch.cat(angles).repeat(1, 2)
        return torch.cat(embeddings), angle.cos(), angle.sin()

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [patches, channels * temporal_patch_size * patch_size^2] of images whose patch grids are
        grid_thw [images, 3] -> each image's embeddings [tokens_per_image, out_hidden_size], in the weights'
        dtype and on their device."""
        grids = self._check(pixel_values, grid_thw)
        weight = self.patch_embed.proj.weight
        hidden = self.patch_embed(pixel_values.to(weight.device, weight.dtype))
        positions, cos, sin = self._positions(grids, weight.device)
        hidden = hidden + positions.to(hidden.dtype)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            hidden = block(hidden, cos, sin, lengths)
        return list(self.merger(hidden).split([self.config.tokens_per_image(grid) for grid in grids]))


def image_rope_positions(grid_thw: tuple[int, int, int], start: int, spatial_merge_size: int
                         ) -> tuple[torch.Tensor, int]:
    """The language model's (temporal, height, width) positions [3, tokens] of an image's tokens whose first
    sits where the next text position would be `start`, and the position the text after the image takes,
    as transformers' Qwen3_5Model.get_rope_index gives them: token (f, r, c) of the merged t x h' x w' grid
    (row-major) is at (start + f, start + r, start + c), and the text resumes at start + max(h', w')."""
    t, h, w = grid_thw[0], grid_thw[1] // spatial_merge_size, grid_thw[2] // spatial_merge_size
    frames, rows, cols = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    positions = torch.stack((frames, rows, cols)).reshape(3, -1) + start
    return positions, start + max(h, w)


def checkpoint_target(name: str) -> str | None:
    """A checkpoint tensor's name in QwenVision, or None for the tensors it does not take (the language
    model's, the multi-token-prediction head's)."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return None
