"""Grouped-query attention over the paged KV cache: q/k/v/o projections (with or without biases), an
optional RMSNorm of each query and key head, rotary embedding (on the whole head or its first
`rotary_dim` values), and the layer's `AttentionGeometry` handed to the backend with its tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from localserve.kernels.rotary import apply_rope
from localserve.models.config import ModelConfig
from localserve.models.layers.norms import RMSNorm
from localserve.models.protocol import ForwardContext
from torch import nn

from localserve.attention.base import AttentionGeometry


@dataclass
class RopeTables:
    """One step's rotary tables: cos, sin [T, rotary width] and the queries' scale [T, 1, 1] (or None)."""

    cos: torch.Tensor
    sin: torch.Tensor
    query_scale: torch.Tensor | None = None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] with its first cos.shape[-1] values rotated (all of them, usually)."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :width], cos, sin), x[..., width:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.geometry = AttentionGeometry(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                          sliding_window=config.attention_of(layer).sliding_window)

    def forward(self, x: torch.Tensor, rope: RopeTables, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        query = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        key = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = rotate(query, rope.cos, rope.sin), rotate(key, rope.cos, rope.sin)
        if rope.query_scale is not None:
            query = query * rope.query_scale
        out = ctx.backend.forward(self.layer, query, key, value, ctx.kv_cache, ctx.metadata, self.geometry)
        return self.o_proj(out.reshape(num_tokens, -1))
