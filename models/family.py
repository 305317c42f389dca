"""What a model family declares about itself (plain data, no torch): how its configs read, which class
serves it, and how its checkpoints' tensor names map onto that class's parameters.

Each family file (models/<family>.py) defines one `Family`, `FAMILY`; the registry (models/registry.py)
finds it by Hugging Face architecture or model type, or by GGUF `general.architecture`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from localserve.models.config import ModelConfig, ModelConfigError, RopeConfig


@dataclass(frozen=True)
class Target:
    """Where (part of) a checkpoint tensor goes in the model.

    `rows`: the rows [start, stop) of the source along `axis` that go there (one part of a fused tensor;
    axis 1 of a stacked expert tensor [E, rows, ...]), every `step`-th of them (gpt-oss interleaves its
    experts' gate and up rows: start 0 or 1, step 2);
    `transpose`: the last two axes swapped after the cut (a checkpoint storing [E, in, out]);
    `expert`: the slot of a stacked expert parameter [E, ...] that this (one expert's) tensor fills;
    `unpermute_heads`: llama.cpp interleaved the rotary halves of this Q or K over that many heads.
    """

    name: str
    rows: tuple[int, int] | None = None
    axis: int = 0
    step: int = 1
    transpose: bool = False
    expert: int | None = None
    unpermute_heads: int | None = None


class GGUFMetadata(Protocol):
    """A GGUF file's metadata as a family reads it (loading/gguf.py gives it)."""

    architecture: str
    source: str  # the file, for messages
    tensor_names: frozenset[str]

    def get(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>`'s value."""

    def general(self, key: str, default: Any = None) -> Any:
        """A key's value as written (`tokenizer.ggml.eos_token_id`, `general.name`)."""

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, outermost first (the transpose of GGUF's own order)."""

    def tensor_values(self, name: str) -> Sequence[float]:
        """A small float tensor's values (`rope_freqs.weight`)."""


# A layer's GGUF tensors (llama.cpp's names without `blk.N.` and `.weight`) -> our names after `model.layers.N.`.
DECODER_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
# Tensors a GGUF may carry that are read into the config, not loaded as weights.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class Family:
    """One model family: how to read its configs, which class to build, how to name its tensors."""

    name: str
    model_class: type  # a CausalLM (models/protocol.py) built from a ModelConfig
    hf_config: Callable[[dict[str, Any], str], ModelConfig]  # (config.json's dict, source) -> config
    gguf_config: Callable[[GGUFMetadata], ModelConfig] | None = None
    layer_tensors: dict[str, str] = field(default_factory=lambda: dict(DECODER_LAYER_TENSORS))
    # A checkpoint name -> its targets, where the family's names differ from the model's; None: the name as is.
    hf_targets: Callable[[str, ModelConfig], list[Target] | None] = lambda name, config: None
    # A GGUF layer tensor (its kind `attn_qkv`, suffix `weight` (or "" for a suffix-less name), our layer
    # prefix `model.layers.N.`) -> its targets (full names), ahead of `layer_tensors` and the shared kinds
    # (fused `attn_qkv`, experts); None: leave it to those.
    gguf_layer_targets: Callable[[str, str, str, ModelConfig], list[Target] | None] = (
        lambda kind, suffix, prefix, config: None)
    unpermute_rotary: bool = False  # llama.cpp interleaves this family's Q/K rotary halves in its GGUFs

    def gguf_targets(self, gguf_name: str, config: ModelConfig) -> list[Target] | None:
        """Where a GGUF tensor goes: [] for one read into the config, None for one the model does not hold."""
        if gguf_name in CONFIG_TENSORS:
            return []
        if gguf_name in GLOBAL_TENSORS:
            return [Target(GLOBAL_TENSORS[gguf_name])]
        parts = gguf_name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
            return None
        _, layer, rest = parts
        # `blk.N.kind.suffix`; llama.cpp also writes suffix-less tensors (`blk.N.ssm_a`) and dotted kinds
        # (`blk.N.nextn.eh_proj.weight`)
        kind, _, suffix = rest.rpartition(".") if "." in rest else (rest, "", "")
        prefix = f"model.layers.{layer}."
        own = self.gguf_layer_targets(kind, suffix, prefix, config)  # the family's own names come first
        if own is not None:
            return own
        if kind in self.layer_tensors:
            heads = None
            if self.unpermute_rotary and kind in ("attn_q", "attn_k"):
                heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
            return [Target(f"{prefix}{self.layer_tensors[kind]}.{suffix}", unpermute_heads=heads)]
        if kind == "attn_qkv":
            q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            heads = (config.num_heads, config.num_kv_heads, None) if self.unpermute_rotary else (None,) * 3
            parts = split_rows([f"{prefix}self_attn.{p}_proj.{suffix}" for p in "qkv"], [q_size, kv_size, kv_size])
            return [Target(t.name, t.rows, unpermute_heads=h) for t, h in zip(parts, heads)]
        if kind in MOE_LAYER_TENSORS or kind == "ffn_gate_up_exps":
            return moe_gguf_targets(kind, suffix, prefix, config)
        return None


def split_rows(names: Sequence[str], sizes: Sequence[int], axis: int = 0) -> list[Target]:
    """Targets for a tensor that stacks `names` (each `sizes[i]` rows along `axis`), in that order."""
    targets, start = [], 0
    for name, size in zip(names, sizes, strict=True):
        targets.append(Target(name, (start, start + size), axis))
        start += size
    return targets


# A mixture-of-experts layer's GGUF tensors -> our names after `model.layers.N.mlp.` (weights; biases beside).
MOE_LAYER_TENSORS = {
    "ffn_gate_inp": "gate",
    "ffn_gate_exps": "experts.gate",
    "ffn_up_exps": "experts.up",
    "ffn_down_exps": "experts.down",
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
    "exp_probs_b": "selection_bias",
}


def moe_gguf_targets(kind: str, suffix: str, prefix: str, config: ModelConfig) -> list[Target] | None:
    """Where llama.cpp's mixture-of-experts tensors go: the router, the stacked experts (`ffn_*_exps`, or
    gate and up fused in `ffn_gate_up_exps`), the shared expert and its gate, the selection bias."""
    mlp = f"{prefix}mlp."
    if kind == "ffn_gate_up_exps":
        size = config.moe.intermediate_size
        names = [f"{mlp}experts.{p}_{'proj' if suffix == 'weight' else 'bias'}" for p in ("gate", "up")]
        return split_rows(names, [size, size], axis=1)
    name = MOE_LAYER_TENSORS[kind]
    if kind == "exp_probs_b":  # llama.cpp names the bias tensor `exp_probs_b.bias`
        return [Target(mlp + name)]
    if name.startswith("experts."):  # stacked: `experts.gate_proj`, `experts.gate_bias`
        return [Target(f"{mlp}{name}_{'proj' if suffix == 'weight' else 'bias'}")]
    return [Target(f"{mlp}{name}.{suffix}")]


def gguf_decoder_fields(meta: GGUFMetadata) -> dict[str, Any]:
    """The ModelConfig fields most GGUF decoders spell alike (llama.cpp's keys under the architecture)."""
    num_heads = int(meta.get("attention.head_count"))
    hidden_size = int(meta.get("embedding_length"))
    vocab = meta.get("vocab_size") or len(meta.general("tokenizer.ggml.tokens", ()))
    freq_factors = None
    if "rope_freqs.weight" in meta.tensor_names:
        freq_factors = tuple(float(x) for x in meta.tensor_values("rope_freqs.weight"))
    scaling = meta.get("rope.scaling.type", "none")
    rope_type = {"none": "default", "linear": "linear", "yarn": "yarn"}.get(scaling)
    if rope_type is None:
        raise ModelConfigError(f"{meta.source}: unsupported rope scaling {scaling!r} in "
                               f"{meta.architecture}.rope.scaling.type")
    rope = RopeConfig(theta=float(meta.get("rope.freq_base", 10000.0)), rope_type=rope_type,
                      factor=float(meta.get("rope.scaling.factor", 1.0)),
                      original_max_position_embeddings=meta.get("rope.scaling.original_context_length"),
                      beta_fast=float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
                      beta_slow=float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
                      attention_factor=meta.get("rope.scaling.yarn_attn_factor"),
                      freq_factors=freq_factors)
    eos = meta.general("tokenizer.ggml.eos_token_id")
    head_dim = meta.get("attention.key_length") or hidden_size // num_heads
    names = meta.tensor_names
    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden_size,
        intermediate_size=int(meta.get("feed_forward_length", 0)),
        num_layers=int(meta.get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get("attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=rope,
        max_position_embeddings=int(meta.get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=meta.general("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
