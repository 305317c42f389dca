"""The project's own model description, built from a Hugging Face `config.json` or GGUF metadata.

Models never see transformers objects: everything they need is in `ModelConfig`. Each family file
(models/<family>.py) reads its own configs into it, with the shared readers below for the fields most
families spell alike. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from localserve.models.pooling import PoolingSpec

from localserve.kv.state_shape import StateShape

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")
EXPERT_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")


class ModelConfigError(ValueError):
    """A model configuration this project cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    # yarn: round the correction range out to whole dimensions (transformers' default); gpt-oss keeps it exact
    truncate: bool = True
    # Per-frequency divisors stored in a GGUF's `rope_freqs.weight` (llama3 scaling there).
    freq_factors: tuple[float, ...] | None = None
    # longrope (Phi-3): per-frequency divisors below and from `original_max_position_embeddings` on.
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    # Llama 4 / Ministral 3: queries at position p scaled by 1 + beta * ln(1 + floor(p / original context)).
    query_scale_beta: float | None = None
    # proportional (Gemma 4's global layers): the first `partial_rotary_factor` of each half of the head turns,
    # at the frequencies of the whole head; the rest does not turn (frequency 0)
    partial_rotary_factor: float = 1.0
    # Multimodal rotary (Qwen3.5): frequency i turns with a token's height position where i % 3 == 1 and
    # i < 3 * sections[1], its width position where i % 3 == 2 and i < 3 * sections[2], else its temporal one
    # (transformers' interleaved mRoPE); used where a step hands 3D positions (models/layers/rotary.py)
    mrope_section: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: how tokens are routed and what the experts are.

    `router`: one of ROUTER_KINDS (models/layers/routers.py defines each); `normalize`: renormalise the k
    chosen weights to sum to 1; `num_groups` / `topk_groups`: grouped selection (sigmoid_grouped);
    `routed_scaling_factor` multiplies the routed experts' weights.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    router: str = "softmax_topk"
    normalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    selection_bias: bool = False  # a bias on the scores used only to choose (DeepSeek-V3 `e_score_correction_bias`)
    expert_bias: bool = False  # biases on the experts' projections
    shared_intermediate_size: int = 0  # one shared expert of this size beside the routed ones; 0: none
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(w . x)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (`intermediate_size` of the model) instead
    # The experts' gated activation, one of EXPERT_ACTIVATIONS (kernels/moe_experts.py defines each):
    # `silu`: silu(gate) * up; `clamped_swiglu` (gpt-oss): its `swiglu_alpha` and `swiglu_limit`.
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.router not in ROUTER_KINDS:
            raise ModelConfigError(f"router kind {self.router!r} is not one of {', '.join(ROUTER_KINDS)}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ModelConfigError(f"expert activation {self.activation!r} is not one of "
                                   f"{', '.join(EXPERT_ACTIVATIONS)}")
        if not self.swiglu_limit > 0:
            raise ModelConfigError(f"swiglu_limit {self.swiglu_limit} must be positive")
        if not 0 < self.top_k <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ModelConfigError(f"{self.num_experts} experts in {self.num_groups} groups, {self.topk_groups} "
                                   "of them chosen: the groups must divide the experts and be chosen from")


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends and keeps its KV, where layers differ (gpt-oss, Gemma 3/4).

    `sliding_window`: each query sees only its last `sliding_window` keys (None: all of them);
    `keys_are_values`: the layer stores no values and attends with its keys as values (the backends compute
    it; no family sets it yet: Gemma 4's `attention_k_eq_v` layers normalise their values and rotate only
    their keys, so they keep both stores, models/gemma4.py); `rope`/`rotary_dim`: the layer's own rotary
    embedding (None: the model's); `state`: a recurrent (linear-attention) layer's per-sequence state: such
    a layer keeps no KV (its `num_kv_heads`/`head_dim` are the full layers', unused).
    """

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    keys_are_values: bool = False
    rope: RopeConfig | None = None
    rotary_dim: int | None = None
    state: StateShape | None = None


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet mixer of a hybrid model's linear-attention layers (Qwen3.5 / Qwen3-Next).

    Queries and keys have `num_key_heads` heads of `key_head_dim`, values `num_value_heads` of
    `value_head_dim` (a multiple of the key heads: each key head serves a group of value heads); a causal
    depthwise convolution of `conv_kernel` taps runs over queries, keys and values together.

    How a checkpoint lays the layer out (models/layers/gated_deltanet.py), Qwen3.5's Hugging Face layout by
    default: `fused_qkvz`: one `in_proj_qkvz` whose rows go, per key head, q, k, then its value heads' v
    and z (Qwen3-Next) instead of `in_proj_qkv` (all q, all k, all v) and `in_proj_z`; `fused_ba`: one
    `in_proj_ba` whose rows go, per key head, its value heads' b then a (Qwen3-Next, and llama.cpp's
    qwen3next GGUFs) instead of `in_proj_b` and `in_proj_a`; `tiled_value_heads`: value head j is served
    by key head j % num_key_heads (llama.cpp's qwen35 GGUFs reorder the value heads so) instead of
    j // (num_value_heads / num_key_heads); `log_decay_rate`: the parameter `A_log` holds log(A) (g =
    -A * softplus(.)), else the parameter `A` holds -A itself (llama.cpp's `ssm_a`).

    Of the model around these layers (models/layers/hybrid.py): `norm_offset`: its RMSNorms (each layer's
    two, the final one, the attention's q/k norms; not the mixer's gated norm) scale by (norm_offset + w):
    1 for Hugging Face checkpoints (zero-centred weights), 0 where the stored weight is the scale itself
    (llama.cpp's GGUFs add the 1).
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    fused_qkvz: bool = False
    fused_ba: bool = False
    tiled_value_heads: bool = False
    log_decay_rate: bool = True
    norm_offset: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"linear attention: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_value_heads % self.num_key_heads:
            raise ModelConfigError(f"linear attention: linear_num_value_heads {self.num_value_heads} must be a "
                                   f"multiple of linear_num_key_heads {self.num_key_heads}")

    @property
    def key_dim(self) -> int:
        """Width of the query (and of the key) projection."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of the value projection (and of the output gate)."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state(self) -> StateShape:
        """The per-sequence state of one such layer."""
        return StateShape(self.conv_dim, self.conv_kernel, self.num_value_heads, self.key_head_dim,
                          self.value_head_dim)


@dataclass(frozen=True)
class GemmaOptions:
    """What Gemma 3 and Gemma 4 do that the plain decoder does not (models/layers/gemma.py computes it).

    `norm_offset`: RMSNorm scales by (offset + w) (Gemma 3's checkpoints store w - 1; llama.cpp's GGUFs and
    Gemma 4 store the scale itself); `attn_logit_softcap`: attention logits squashed to cap * tanh(l / cap);
    `value_norm`: values RMS-normalised (no scale) per head (Gemma 4); `values_from_keys`: the full-attention
    layers have no value projection, their values are the key projection's output (Gemma 4's
    `attention_k_eq_v`); `layer_scale`: each layer's output times a learned scalar (Gemma 4); `moe_beside_mlp`:
    the mixture of experts runs beside the dense MLP, each with its own norms (Gemma 4's 26B-A4B).
    """

    norm_offset: float = 0.0
    attn_logit_softcap: float | None = None
    value_norm: bool = False
    values_from_keys: bool = False
    layer_scale: bool = False
    moe_beside_mlp: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and features of a decoder-only language model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    # An embedding model's pooling (loading/pooling_config.py); None for a generation model.
    pooling: PoolingSpec | None = None
    # The registry's family (models/registry.py); "" for a config built by hand (the Llama decoder).
    family: str = ""
    moe: MoEConfig | None = None
    rotary_dim: int | None = None  # rotary embedding on the first `rotary_dim` of each head; None: all of it
    # Parts of a multimodal checkpoint left unloaded (e.g. "vision tower"): said at start.
    unloaded_parts: tuple[str, ...] = ()
    # Per-layer attention where layers differ (one entry per layer); empty: every layer as the fields above.
    layer_attention: tuple[LayerAttention, ...] = ()
    # A learned logit per attention head in every softmax's denominator (gpt-oss's sinks, `self_attn.sinks`).
    attention_sinks: bool = False
    attention_scale: float | None = None  # the attention logits' scale; None: 1 / sqrt(head_dim)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embedding_scale: float | None = None  # token embeddings times this (in their dtype); None: 1
    final_logit_softcap: float | None = None  # logits squashed to cap * tanh(logits / cap)
    gemma: GemmaOptions | None = None
    # Hybrid models: the linear-attention mixer, and which layers use it (`layer_attention` entries with a
    # `state`); None: every layer attends.
    linear_attention: LinearAttentionConfig | None = None

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state instead of KV (linear-attention layers)."""
        return tuple(i for i, a in enumerate(self.layer_attention) if a.state is not None)

    def is_recurrent_layer(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention layer (keeps a state, no KV)."""
        return bool(self.layer_attention) and self.layer_attention[layer].state is not None

    @property
    def kv_bytes_per_token_fp16(self) -> int:
        """Bytes of K and V for one token over all attending layers in a 16-bit cache (recurrent layers keep
        no KV)."""
        return 2 * (self.num_layers - len(self.recurrent_layers)) * self.num_kv_heads * self.head_dim * 2

    @property
    def context_length(self) -> int:
        """Longest sequence the model serves (a sliding window does not cap it: its layers keep only the
        window's KV, kv/layer_groups.py)."""
        return self.max_position_embeddings

    def attention_of(self, layer: int) -> LayerAttention:
        """How `layer` attends: its entry in `layer_attention`, else the model-wide fields."""
        if self.layer_attention:
            return self.layer_attention[layer]
        return LayerAttention(self.num_kv_heads, self.head_dim, self.sliding_window, rotary_dim=self.rotary_dim)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and layer not in self.moe.dense_layers


def hf_decoder_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The fields of a ModelConfig that most Hugging Face decoder configs spell alike (a family adds or
    overrides its own). ModelConfigError names a missing field."""
    try:
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden_size // num_heads
        eos = config.get("eos_token_id")
        return dict(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=rope_from_hf(config, source),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", False)),
            o_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )
    except KeyError as exc:
        raise ModelConfigError(f"{source}: missing field {exc.args[0]!r}") from None


def rope_from_hf(config: dict[str, Any], source: str) -> RopeConfig:
    """The rotary parameters of a Hugging Face config (transformers 4.x `rope_scaling` or 5.x
    `rope_parameters`); an unknown rope type is refused naming the field."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        field_name = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
        raise ModelConfigError(f"{source}: unsupported rope type {rope_type!r} in {field_name}; supported: "
                               f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if rope_type == "yarn" and original is None:
        original = config.get("max_position_embeddings")
    factor = params.get("factor")
    if rope_type == "longrope" and factor is None and original:
        factor = config.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if rope_type == "yarn" and attention_factor is None and params.get("mscale") and params.get("mscale_all_dim"):
        # DeepSeek's and Ministral 3's yarn: the ratio of two mscales (1 when they are equal)
        attention_factor = _yarn_mscale(float(factor or 1.0), params["mscale"]) / _yarn_mscale(
            float(factor or 1.0), params["mscale_all_dim"])
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=attention_factor,
        truncate=bool(params.get("truncate", True)),
        short_factor=_floats(params.get("short_factor")),
        long_factor=_floats(params.get("long_factor")),
        query_scale_beta=params.get("llama_4_scaling_beta"),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0,
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _floats(values: list | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)
