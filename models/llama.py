"""One Llama-family decoder: Llama 2/3/3.x, SmolLM2, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

RMSNorm, RoPE, SwiGLU, grouped-query attention over a paged KV cache, tied or untied embeddings.
Parameter names follow Hugging Face, so checkpoints load by name. The loader may swap linear layers and
the embeddings for their GGUF-quantized twins (quantized.py), which take the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from localserve.kernels.rotary import apply_rope
from localserve.models.config import ModelConfig
from localserve.models.quantized import QuantizedEmbedding
from localserve.models.rope import RotaryEmbedding
from torch import nn

if TYPE_CHECKING:
    from localserve.attention.base import AttentionBackend
    from localserve.kv.cache import PagedKVCache


@dataclass
class ForwardContext:
    """What attention needs besides activations; passed down explicitly, never held in globals."""

    backend: AttentionBackend
    kv_cache: PagedKVCache
    metadata: Any  # what backend.build_metadata made for this step


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (at least) as the reference does, then scale in the run dtype.
        normed = nn.functional.rms_norm(x if x.dtype in (torch.float32, torch.float64) else x.float(),
                                        (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        query = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        key = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        out = ctx.backend.forward(self.layer, query, key, value, ctx.kv_cache, ctx.metadata)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its output head. Build on the meta device, then load weights by HF name.

    An embedding model (`config.pooling` set) has no head of its own: its checkpoint holds none, and only
    its final hidden states are read. Tied to its embeddings it can still compute logits.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings and config.pooling is None:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    def init_rope(self, device: torch.device | str) -> None:
        """(Re)compute the rotary frequencies on `device`; needed after building on the meta device."""
        self.rotary = RotaryEmbedding(self.config.rope, self.config.head_dim, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size] after the final norm."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    @property
    def can_generate(self) -> bool:
        """Whether it has an output head (its own or its tied embeddings) to compute logits with."""
        return self.config.tie_word_embeddings or hasattr(self, "lm_head")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size], in float32 at least."""
        if not self.config.tie_word_embeddings:
            logits = self.lm_head(hidden)
        elif isinstance(self.model.embed_tokens, QuantizedEmbedding):  # a GGUF's blocks, kept quantized
            logits = self.model.embed_tokens.linear(hidden)
        else:
            logits = nn.functional.linear(hidden, self.model.embed_tokens.weight)
        return logits if logits.dtype == torch.float64 else logits.float()
