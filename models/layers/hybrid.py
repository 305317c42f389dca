"""The hybrid decoder of Qwen3.5 / Qwen3.6 / Qwen3-Next: most layers mix tokens with a Gated DeltaNet
(gated_deltanet.py, `linear_attn`), every few a full-attention layer (`self_attn`), each followed by a
gated MLP or a mixture of experts with a gated shared expert (moe.py).

What differs from the plain decoder (decoder.py):
- The full-attention layers' `q_proj` emits, per head, the query then an output gate of the same size
  ([H, 2, D] row order); the attention's output is multiplied by sigmoid(gate) before `o_proj`.
- Queries and keys are RMS-normalised per head; only the first `rotary_dim` of each head turns
  (`partial_rotary_factor`, 0.25 in these models).
- Every RMSNorm but the mixer's gated one scales by (offset + w) in float32 (`LinearAttentionConfig.norm_offset`:
  1 for Hugging Face checkpoints, whose weights are zero-centred).
- A linear layer keeps no KV (ModelConfig.attention_of(layer).state): it reads and writes the step's
  recurrent states (ForwardContext.states).
"""

from __future__ import annotations

import torch
from localserve.models.config import ModelConfig
from localserve.models.layers.attention import Attention, RopeTables, rotate
from localserve.models.layers.decoder import DecoderForCausalLM, make_mlp
from localserve.models.layers.gated_deltanet import GatedDeltaNet
from localserve.models.layers.linear import QuantizedLinear
from localserve.models.layers.norms import GemmaRMSNorm
from localserve.models.protocol import ForwardContext
from torch import nn

from localserve.attention.base import AttentionGeometry


class GatedAttention(Attention):
    """Grouped-query attention with a sigmoid output gate from `q_proj` and offset q/k norms (module doc)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        offset = config.linear_attention.norm_offset
        self.q_proj = nn.Linear(config.hidden_size, 2 * self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, offset)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, offset)

    def forward(self, x: torch.Tensor, rope: RopeTables, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        query, gate = self.q_proj(x).view(num_tokens, self.num_heads, 2, self.head_dim).unbind(2)
        key = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = self.q_norm(query), self.k_norm(key)
        query, key = rotate(query, rope.cos, rope.sin), rotate(key, rope.cos, rope.sin)
        out = ctx.backend.forward(self.layer, query, key, value, ctx.kv_cache, ctx.metadata, self.geometry)
        out = out.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        offset, eps = config.linear_attention.norm_offset, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps, offset)
        self.recurrent = config.is_recurrent_layer(layer)
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(config.hidden_size, config.linear_attention, eps, layer)
        else:
            self.self_attn = GatedAttention(config, layer)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps, offset)
        self.mlp = make_mlp(config, layer)

    def forward(self, x: torch.Tensor, rope: RopeTables, ctx: ForwardContext) -> torch.Tensor:
        normed = self.input_layernorm(x)
        x = x + (self.linear_attn(normed, ctx) if self.recurrent else self.self_attn(normed, rope, ctx))
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridDecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, config.linear_attention.norm_offset)


class HybridForCausalLM(DecoderForCausalLM):
    """The hybrid decoder plus its output head, a `CausalLM` whose forward needs `ctx.states` (module doc)."""

    model_class = HybridDecoderModel

    def __init__(self, config: ModelConfig) -> None:
        if config.linear_attention is None:
            raise ValueError(f"{config.name}: a hybrid model needs its linear attention's config")
        super().__init__(config)

    @property
    def supports_cuda_graphs(self) -> bool:
        """Recurrent layers save states at points each step chooses: decode graphs do not capture them."""
        return False

    def _attention_layers(self) -> list[GatedAttention]:
        return [layer.self_attn for layer in self.model.layers if not layer.recurrent]

    def attention_geometry(self) -> list[AttentionGeometry]:
        """Each layer's geometry; a linear layer (no KV, no attention) reports the full layers' one."""
        full = self._attention_layers()[0].geometry
        return [full if layer.recurrent else layer.self_attn.geometry for layer in self.model.layers]

    def calibration_sample(self) -> list[torch.Tensor]:
        attention = self._attention_layers()
        projections = (attention[0].k_proj, attention[-1].v_proj)
        return [p.blocks if isinstance(p, QuantizedLinear) else p.weight for p in projections]
