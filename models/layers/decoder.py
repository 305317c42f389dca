"""The decoder most families are: token embeddings, layers of (norm, attention, norm, MLP) with residuals,
a final norm and an output head (its own, or tied to the embeddings). A layer's MLP is the gated MLP, or
the mixture of experts where the config says so. Parameter names follow Hugging Face's Llama
(`model.layers.N.self_attn.q_proj.weight`); each family maps its checkpoint's names onto them.
"""

from __future__ import annotations

import torch
from localserve.models.config import ModelConfig
from localserve.models.layers.attention import Attention, RopeTables
from localserve.models.layers.linear import QuantizedEmbedding, QuantizedLinear
from localserve.models.layers.mlp import GatedMLP
from localserve.models.layers.norms import RMSNorm
from localserve.models.layers.rotary import RotaryEmbedding
from localserve.models.protocol import ForwardContext
from torch import nn

from localserve.attention.base import AttentionGeometry


def make_mlp(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a mixture of experts where the config has one for it, else the gated MLP."""
    if config.is_moe_layer(layer):
        from localserve.models.layers.moe import MoE

        return MoE(config.hidden_size, config.moe, config.mlp_bias)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)


def place_input_embeds(x: torch.Tensor, ctx: ForwardContext, scale: float | None = None) -> torch.Tensor:
    """`x` [T, hidden] (the tokens' input embeddings, the family's own scale applied) with the rows that
    `ctx.input_embeds` names (an image's tokens) replaced by its embeddings, times `scale` where the family
    scales them (None: as they are). The hook each family's forward calls once it has its token embeddings:
    Gemma 3 calls it after its sqrt(hidden) scale with none (transformers scatters the image features into
    the scaled token embeddings)."""
    given = ctx.input_embeds
    if given is None:
        return x
    values = given.values.to(x.dtype)
    return x.index_copy(0, given.rows, values if scale is None else values * scale)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer)

    def forward(self, x: torch.Tensor, rope: RopeTables, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """The decoder plus its output head, a `CausalLM`. Build on the meta device, then load weights by name.

    An embedding model (`config.pooling` set) has no head of its own: its checkpoint holds none, and only
    its final hidden states are read. Tied to its embeddings it can still compute logits.
    """

    model_class: type[nn.Module] = DecoderModel  # the layers' stack (`model`), built from the config

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        if not config.tie_word_embeddings and config.pooling is None:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.rotary_dim or config.head_dim)

    def init_rope(self, device: torch.device | str) -> None:
        """(Re)compute the rotary frequencies on `device`; needed after building on the meta device."""
        self.rotary = RotaryEmbedding(self.config.rope, self.config.rotary_dim or self.config.head_dim, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size] after the final norm. A model with
        multimodal rotary (Qwen3.5) takes positions [3, T] too (models/layers/rotary.py)."""
        x = place_input_embeds(self.model.embed_tokens(input_ids), ctx)
        rope = RopeTables(*self.rotary(positions, x.dtype), self.rotary.query_scale(positions, x.dtype))
        for layer in self.model.layers:
            x = layer(x, rope, ctx)
        return self.model.norm(x)

    @property
    def can_generate(self) -> bool:
        """Whether it has an output head (its own or its tied embeddings) to compute logits with."""
        return self.config.tie_word_embeddings or hasattr(self, "lm_head")

    @property
    def supports_cuda_graphs(self) -> bool:
        """A mixture of experts is captured only through its fused kernels (the torch path synchronises)."""
        return all(getattr(layer.mlp, "supports_cuda_graphs", True) for layer in self.model.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size], in float32 at least."""
        if not self.config.tie_word_embeddings:
            logits = self.lm_head(hidden)
        elif isinstance(self.model.embed_tokens, QuantizedEmbedding):  # a GGUF's blocks, kept quantized
            logits = self.model.embed_tokens.linear(hidden)
        else:
            logits = nn.functional.linear(hidden, self.model.embed_tokens.weight)
        return logits if logits.dtype == torch.float64 else logits.float()

    def attention_geometry(self) -> list[AttentionGeometry]:
        return [layer.self_attn.geometry for layer in self.model.layers]

    def calibration_sample(self) -> list[torch.Tensor]:
        projections = (self.model.layers[0].self_attn.k_proj, self.model.layers[-1].self_attn.v_proj)
        return [p.blocks if isinstance(p, QuantizedLinear) else p.weight for p in projections]
