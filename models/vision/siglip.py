"""SigLIP's vision transformer as transformers' SiglipVisionModel computes it (without its pooling head, which
Gemma 3 does not use): a strided convolution cuts the image into patches, a learned embedding per patch
position is added, then pre-norm encoder layers (LayerNorm, full bidirectional attention with biases,
LayerNorm, a gelu-tanh MLP) and a final LayerNorm. Module names follow the checkpoints' tensor names
(`embeddings.patch_embedding`, `encoder.layers.N.self_attn.q_proj`, `post_layernorm`, ...)."""

from __future__ import annotations

import torch
from localserve.models.vision.config import SiglipConfig
from torch import nn
from torch.nn import functional as F


class SiglipEmbeddings(nn.Module):
    """Pixels [images, channels, size, size] -> patch embeddings plus their positions [images, patches, hidden]."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values)  # [images, hidden, side, side]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight  # patches row by row


class SiglipAttention(nn.Module):
    """Multi-head attention of every patch over every patch of its image (no mask), biases on all four."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        images, patches, _ = hidden.shape

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(hidden).view(images, patches, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj),
                                             scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(images, patches, -1))


class SiglipMLP(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = config.gelu_approximate

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(hidden), approximate=self.approximate))


class SiglipEncoderLayer(nn.Module):
    """x + attention(norm1(x)), then + mlp(norm2(.))."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class SiglipEncoder(nn.Module):
    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_layers))


class SiglipVisionTower(nn.Module):
    """Pixel values [images, channels, image_size, image_size] -> the last hidden states [images, patches,
    hidden] after the post LayerNorm (transformers' `last_hidden_state`)."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)
