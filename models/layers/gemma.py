"""The Gemma 3 / Gemma 4 decoder: what these families do that the plain decoder (decoder.py) does not.

- Token embeddings times sqrt(hidden) (`ModelConfig.embedding_scale`, rounded to the embeddings' dtype first,
  as transformers does); RMSNorm in float32 scaled by (offset + w) (`GemmaOptions.norm_offset`).
- Sandwich norms: each layer normalises the attention's and the MLP's inputs and outputs
  (`input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`).
- GeGLU (`hidden_act` "gelu_tanh"); an RMSNorm on every query and key head (and on every value head, without
  a scale, in Gemma 4); the logits' scale from the config (Gemma 3's `query_pre_attn_scalar`, Gemma 4's 1).
- Layers differ (`ModelConfig.layer_attention`): sliding-window layers and full-attention layers, each kind
  with its own rotary embedding (theta, scaling, Gemma 4's proportional partial rotary), and in Gemma 4 the
  full layers with their own head size and KV heads, and values from the key projection (`values_from_keys`:
  no value projection; the values are the key projection's output normalised without a scale and never
  rotated, so they differ from the keys, which are normalised with a scale and rotated: the cache keeps both).
- Gemma 4's mixture of experts runs beside the dense MLP (26B-A4B): its router normalises the layer's input
  (no scale), scales it by a learned vector and 1 / sqrt(hidden), takes softmax then the top k renormalised,
  and weighs each chosen expert by its own learned scale; the experts see the input through their own norm,
  and each branch's output has its own norm before they are summed. Each layer's output is then multiplied
  by a learned scalar (`layer_scalar`).
- Final logits soft-capped (cap * tanh(logits / cap)) where the config says.

Parameter names follow transformers' (`model.layers.N.pre_feedforward_layernorm.weight`,
`model.layers.N.router.proj.weight`, `model.layers.N.experts.gate_proj`).
"""

from __future__ import annotations

import torch
from localserve.models.config import ModelConfig, MoEConfig
from localserve.models.layers.attention import RopeTables, rotate
from localserve.models.layers.decoder import DecoderForCausalLM, place_input_embeds
from localserve.models.layers.linear import QuantizedLinear
from localserve.models.layers.mlp import GatedMLP
from localserve.models.layers.moe import RoutedExperts, fused_moe_kernel, run_experts
from localserve.models.layers.norms import GemmaRMSNorm
from localserve.models.layers.rotary import RotaryEmbedding
from localserve.models.layers.routers import route
from localserve.models.protocol import ForwardContext
from torch import nn

from localserve.attention.base import AttentionGeometry


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        gemma, shape = config.gemma, config.attention_of(layer)
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, shape.num_kv_heads, shape.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        if not (gemma.values_from_keys and shape.sliding_window is None):
            self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, gemma.norm_offset)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, gemma.norm_offset)
        if gemma.value_norm:
            self.v_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, scale=False)
        scale = config.attention_scale if config.attention_scale is not None else self.head_dim ** -0.5
        self.geometry = AttentionGeometry(self.num_heads, self.num_kv_heads, self.head_dim, scale,
                                          sliding_window=shape.sliding_window, logit_softcap=gemma.attn_logit_softcap)

    def forward(self, x: torch.Tensor, rope: RopeTables, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        query = self.q_norm(self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim))
        key = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim) if hasattr(self, "v_proj") else key
        if hasattr(self, "v_norm"):
            value = self.v_norm(value)
        key = self.k_norm(key)
        query, key = rotate(query, rope.cos, rope.sin), rotate(key, rope.cos, rope.sin)
        out = ctx.backend.forward(self.layer, query, key, value, ctx.kv_cache, ctx.metadata, self.geometry)
        return self.o_proj(out.reshape(num_tokens, -1))


class GemmaRouter(nn.Module):
    """Gemma 4's router: (k expert ids, their weights) from the layer's input."""

    def __init__(self, hidden_size: int, moe: MoEConfig, eps: float) -> None:
        super().__init__()
        self.moe = moe
        self.norm = GemmaRMSNorm(hidden_size, eps, scale=False)
        self.proj = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))
        self.root = hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        weights, ids = route(self.proj(self.norm(x) * self.scale * self.root), self.moe)
        return weights * self.per_expert_scale[ids].float(), ids


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        gemma, hidden = config.gemma, config.hidden_size

        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(hidden, config.rms_norm_eps, gemma.norm_offset)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = GemmaAttention(config, layer)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.mlp_bias, config.hidden_act)
        if config.is_moe_layer(layer):
            self.router = GemmaRouter(hidden, config.moe, config.rms_norm_eps)
            self.experts = RoutedExperts(config.moe.num_experts, hidden, config.moe.intermediate_size,
                                         activation={"activation": config.hidden_act})
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
        if gemma.layer_scale:
            self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, rope: RopeTables, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, ctx))
        out = self.mlp(self.pre_feedforward_layernorm(x))
        if hasattr(self, "experts"):
            weights, ids = self.router(x)
            routed = run_experts(self.pre_feedforward_layernorm_2(x), self.experts.experts(), ids, weights)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(out)
        return x * self.layer_scalar if hasattr(self, "layer_scalar") else x


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma.norm_offset)


class GemmaForCausalLM(nn.Module):
    """A `CausalLM` for Gemma 3 and Gemma 4 text models. Build on the meta device, then load weights by name."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # One rotary embedding per distinct (rope, rotated width); each layer uses its kind's.
        kinds = [(shape.rope or config.rope, shape.rotary_dim or shape.head_dim)
                 for shape in map(config.attention_of, range(config.num_layers))]
        self.rope_kinds = list(dict.fromkeys(kinds))
        self.layer_rope = [self.rope_kinds.index(kind) for kind in kinds]
        self.init_rope(None)

    def init_rope(self, device: torch.device | str | None) -> None:
        """(Re)compute the rotary frequencies on `device`; needed after building on the meta device."""
        self.rotaries = nn.ModuleList(RotaryEmbedding(rope, width, device=device) for rope, width in self.rope_kinds)

    @property
    def rotary(self) -> RotaryEmbedding:
        """The first layer's rotary embedding (the calibrated KV formats' only one)."""
        return self.rotaries[self.layer_rope[0]]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size] after the final norm."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        x = place_input_embeds(x, ctx)  # after the scale: Gemma 3's image embeddings are not scaled
        tables = [RopeTables(*rotary(positions, x.dtype)) for rotary in self.rotaries]
        for layer, kind in zip(self.model.layers, self.layer_rope):
            x = layer(x, tables[kind], ctx)
        return self.model.norm(x)

    can_generate = DecoderForCausalLM.can_generate  # the same head, own or tied
    attention_geometry = DecoderForCausalLM.attention_geometry

    @property
    def supports_cuda_graphs(self) -> bool:
        """Experts are captured only through their fused kernels (the torch path synchronises)."""
        has_experts = any(hasattr(layer, "experts") for layer in self.model.layers)
        return not has_experts or fused_moe_kernel() is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32 at least, soft-capped where set."""
        logits = DecoderForCausalLM.compute_logits(self, hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def calibration_sample(self) -> list[torch.Tensor]:
        projections = (self.model.layers[0].self_attn.k_proj, self.model.layers[-1].self_attn.o_proj)
        return [p.blocks if isinstance(p, QuantizedLinear) else p.weight for p in projections]
