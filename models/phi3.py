"""Phi-3, Phi-3.5 and Phi-4 (`Phi3ForCausalLM`; GGUF `phi3`): the plain decoder, with Q, K and V in one
projection (`qkv_proj`) and gate and up in another (`gate_up_proj`, gate rows first), split into the
decoder's separate projections as they load (whole rows: quantized blocks split as they are). Rotary
embedding on the first `partial_rotary_factor` of each head (Phi-4-mini: 3/4), longrope scaling (Phi-3's
128k models: short factors up to the original context, long ones from there on, by each token's position).
"""

from __future__ import annotations

from typing import Any

from localserve.models.config import ModelConfig, ModelConfigError, RopeConfig, hf_decoder_fields
from localserve.models.family import (
    DECODER_LAYER_TENSORS,
    Family,
    GGUFMetadata,
    Target,
    gguf_decoder_fields,
    split_rows,
)
from localserve.models.layers.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """The shared decoder under the name its checkpoints declare (what logs and reports show); the family's
    differences are in its config reading and tensor names, not in code."""


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    fields = hf_decoder_fields(config, source) | {"qkv_bias": False, "o_bias": False, "mlp_bias": False}
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(fields["head_dim"] * partial)
    return ModelConfig(architecture="Phi3ForCausalLM", **fields, sliding_window=config.get("sliding_window"),
                       rotary_dim=None if rotary_dim == fields["head_dim"] else rotary_dim)


def hf_targets(name: str, config: ModelConfig) -> list[Target] | None:
    stem, _, kind = name.rpartition(".")
    if stem.endswith("self_attn.qkv_proj"):
        attention = stem.removesuffix("qkv_proj")
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return split_rows([f"{attention}{p}_proj.{kind}" for p in "qkv"], [q_size, kv_size, kv_size])
    if stem.endswith("mlp.gate_up_proj"):
        mlp = stem.removesuffix("gate_up_proj")
        size = config.intermediate_size
        return split_rows([f"{mlp}gate_proj.{kind}", f"{mlp}up_proj.{kind}"], [size, size])
    return None


def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    fields = gguf_decoder_fields(meta)
    rope = fields["rope"]
    if "rope_factors_short.weight" in meta.tensor_names:
        original = meta.get("rope.scaling.original_context_length")
        if original is None:
            raise ModelConfigError(f"{meta.source}: longrope factors without phi3.rope.scaling.original_context_length")
        rope = RopeConfig(theta=rope.theta, rope_type="longrope", original_max_position_embeddings=int(original),
                          factor=fields["max_position_embeddings"] / int(original),
                          attention_factor=meta.get("rope.scaling.attn_factor"),
                          short_factor=tuple(meta.tensor_values("rope_factors_short.weight")),
                          long_factor=tuple(meta.tensor_values("rope_factors_long.weight")))
    rotary_dim = meta.get("rope.dimension_count")
    window = meta.get("attention.sliding_window") or None
    return ModelConfig(architecture="Phi3ForCausalLM", **fields | {"rope": rope}, sliding_window=window,
                       rotary_dim=None if rotary_dim in (None, fields["head_dim"]) else int(rotary_dim))


def gguf_layer_targets(kind: str, suffix: str, prefix: str, config: ModelConfig) -> list[Target] | None:
    if kind == "ffn_up":  # llama.cpp keeps Phi-3's gate and up fused, under ffn_up
        size = config.intermediate_size
        return split_rows([f"{prefix}mlp.gate_proj.{suffix}", f"{prefix}mlp.up_proj.{suffix}"], [size, size])
    return None


FAMILY = Family(name="phi3", model_class=Phi3ForCausalLM, hf_config=hf_config, gguf_config=gguf_config,
                hf_targets=hf_targets, gguf_layer_targets=gguf_layer_targets,
                layer_tensors={k: v for k, v in DECODER_LAYER_TENSORS.items() if k != "ffn_up"})
