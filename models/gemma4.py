"""Gemma 4 (`Gemma4ForCausalLM` / `gemma4_text`; the text part of `Gemma4ForConditionalGeneration`; GGUF
`gemma4`): the Gemma decoder of models/layers/gemma.py, dense (31B) and with a mixture of experts beside
the dense MLP (26B-A4B).

Sliding-window layers (head size `head_dim`, `num_key_value_heads`, default rope) and every N-th a full
layer with its own head size and KV heads (`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads`:
512 and fewer heads in the released models), proportional rope on a quarter of the head, and with
`attention_k_eq_v` no value projection (values = the key projection, normalised without a scale, unrotated).
Norms scale by w (no offset); values are RMS-normalised; the logits' scale is 1; every layer's output is
multiplied by its `layer_scalar`.

`LayerAttention.keys_are_values` stays False for the full layers: their keys are k_norm(k_proj x) rotated,
their values v_norm(k_proj x) unrotated (transformers' Gemma4TextAttention), not the same tensor, so the cache
keeps both. (Keys could be derived from the stored values, rope(value * k_norm.weight) at the key's position,
which would save the value store: a kernel feature, not done.)

Refused by name: per-layer input embeddings (`hidden_size_per_layer_input`, the E2B/E4B models), layers
that reuse earlier layers' KV (`num_kv_shared_layers`), bidirectional attention over all tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from localserve.models.config import (
    GemmaOptions,
    LayerAttention,
    ModelConfig,
    ModelConfigError,
    MoEConfig,
    RopeConfig,
)
from localserve.models.family import Family, GGUFMetadata, Target, gguf_decoder_fields, split_rows
from localserve.models.gemma3 import (
    GEMMA_LAYER_TENSORS,
    gemma_fields,
    gguf_window_kinds,
    layer_ropes,
    layer_types,
    refuse_bidirectional,
    text_config,
)
from localserve.models.gemma3 import (
    hf_targets as multimodal_targets,
)
from localserve.models.layers.gemma import GemmaForCausalLM

DEFAULT_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}
LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # what a `per_layer_config` entry may set
# Features of the E2B/E4B models not served: (config field, GGUF key)
REFUSED = (("hidden_size_per_layer_input", "embedding_length_per_layer_input"),
           ("num_kv_shared_layers", "attention.shared_kv_layers"))
GEMMA4_LAYER_TENSORS = GEMMA_LAYER_TENSORS | {"pre_ffw_norm_2": "pre_feedforward_layernorm_2",
                                              "post_ffw_norm_1": "post_feedforward_layernorm_1",
                                              "post_ffw_norm_2": "post_feedforward_layernorm_2"}


class Gemma4ForCausalLM(GemmaForCausalLM):
    """The Gemma decoder under the name its checkpoints declare (what logs and reports show)."""


def per_layer_shapes(text: dict[str, Any], kinds: list[str], fields: dict[str, Any],
                     source: str) -> list[tuple[int, int]]:
    """Each layer's (KV heads, head size), as transformers resolves them."""
    overrides = text.get("per_layer_config")
    if overrides is None:  # transformers' defaults: the full layers' head size 512, their KV heads if k = v
        full = {"head_dim": text.get("global_head_dim", 512)}
        if text.get("attention_k_eq_v", True) and text.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = text["num_global_key_value_heads"]
        overrides = {str(i): full for i, kind in enumerate(kinds) if kind == "full_attention"}
    shapes = []
    for layer in range(len(kinds)):
        own = overrides.get(str(layer)) or overrides.get(layer) or {}
        unknown = set(own) - set(LAYER_OVERRIDES)
        if unknown:
            raise ModelConfigError(f"{source}: per_layer_config[{layer}] sets {', '.join(sorted(unknown))}; only "
                                   f"{', '.join(LAYER_OVERRIDES)} are read")
        shapes.append((int(own.get("num_key_value_heads", fields["num_kv_heads"])),
                       int(own.get("head_dim", fields["head_dim"]))))
    return shapes


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    text = text_config(config)
    for name, _ in REFUSED:
        if text.get(name):
            raise ModelConfigError(f"{source}: {name} = {text[name]} is not supported (Gemma 4's E2B/E4B "
                                   "models); the 31B and 26B-A4B models have none")
    refuse_bidirectional(text, source)
    fields = gemma_fields(config, source)
    kinds = layer_types(text, fields["num_layers"], source)
    window = int(text.get("sliding_window") or 512)
    ropes = layer_ropes(text, source, DEFAULT_ROPES)
    layers = tuple(LayerAttention(kv_heads, head_dim, window if kind == "sliding_attention" else None,
                                  rope=ropes[kind])
                   for kind, (kv_heads, head_dim) in zip(kinds, per_layer_shapes(text, kinds, fields, source)))
    moe = None
    if text.get("enable_moe_block"):
        try:
            moe = MoEConfig(num_experts=int(text["num_experts"]), top_k=int(text["top_k_experts"]),
                            intermediate_size=int(text["moe_intermediate_size"]), router="softmax_topk",
                            normalize=True)
        except (KeyError, TypeError):
            raise ModelConfigError(f"{source}: enable_moe_block needs num_experts, top_k_experts and "
                                   "moe_intermediate_size") from None
        except ModelConfigError as exc:
            raise ModelConfigError(f"{source}: {exc}") from None
    gemma = GemmaOptions(value_norm=True, values_from_keys=bool(text.get("attention_k_eq_v", False)),
                         layer_scale=True, moe_beside_mlp=moe is not None)
    unloaded = tuple(part for key, part in (("vision_config", "vision tower"), ("audio_config", "audio tower"))
                     if config.get(key))
    return ModelConfig(architecture=config["architectures"][0], **fields | {"rope": ropes["full_attention"]},
                       layer_attention=layers, attention_scale=1.0, gemma=gemma, moe=moe, unloaded_parts=unloaded)


def hf_targets(name: str, config: ModelConfig) -> list[Target] | None:
    targets = multimodal_targets(name, config)
    if targets == []:
        return []
    name = targets[0].name if targets else name
    if name.endswith(".experts.gate_up_proj"):
        stem = name.removesuffix("gate_up_proj")
        size = config.moe.intermediate_size
        return split_rows([stem + "gate_proj", stem + "up_proj"], [size, size], axis=1)
    return [Target(name)]


class _LayerShapes:
    """A GGUF's metadata as gguf_decoder_fields reads it, with per-layer arrays taken at a sliding layer."""

    def __init__(self, meta: GGUFMetadata, sliding: int) -> None:
        self.meta, self.sliding = meta, sliding
        self.architecture, self.source, self.tensor_names = meta.architecture, meta.source, meta.tensor_names
        self.general, self.tensor_shape, self.tensor_values = meta.general, meta.tensor_shape, meta.tensor_values

    def get(self, key: str, default: Any = None) -> Any:
        value = self.meta.get(key, default)
        if key == "attention.key_length":
            return self.meta.get("attention.key_length_swa", value)
        return value[self.sliding] if isinstance(value, (list, tuple)) else value


def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    for name, key in REFUSED:
        if meta.get(key):
            raise ModelConfigError(f"{meta.source}: gemma4.{key} = {meta.get(key)} ({name}) is not supported")
    num_layers = int(meta.get("block_count"))
    kinds = gguf_window_kinds(meta, num_layers, 6)
    if "sliding_attention" not in kinds:
        raise ModelConfigError(f"{meta.source}: gemma4.attention.sliding_window_pattern names no sliding layer")
    sliding = kinds.index("sliding_attention")
    feed_forward = meta.get("feed_forward_length")
    if isinstance(feed_forward, (list, tuple)) and len(set(feed_forward)) > 1:
        raise ModelConfigError(f"{meta.source}: gemma4.feed_forward_length differs between layers (a double-wide "
                               "MLP of KV-sharing layers), which is not supported")
    fields = gguf_decoder_fields(_LayerShapes(meta, sliding))
    kv_heads = meta.get("attention.head_count_kv", fields["num_heads"])
    kv_heads = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * num_layers
    full_head_dim = int(meta.get("attention.key_length") or fields["head_dim"])
    window = meta.get("attention.sliding_window")
    if not window:
        raise ModelConfigError(f"{meta.source}: a gemma4 file needs gemma4.attention.sliding_window")
    local = RopeConfig(theta=float(meta.get("rope.freq_base_swa", 10_000.0)))
    rotary_swa = meta.get("rope.dimension_count_swa")
    # The full layers' rope: the file's frequency factors (1, then 1e30 for the frequencies that stay still)
    # over the whole head are llama.cpp's form of the proportional rope
    full_rope = fields["rope"]
    layers = []
    for layer, kind in enumerate(kinds):
        if kind == "sliding_attention":
            rotary = None if rotary_swa in (None, fields["head_dim"]) else int(rotary_swa)
            layers.append(LayerAttention(int(kv_heads[layer]), fields["head_dim"], int(window), rope=local,
                                         rotary_dim=rotary))
        else:
            layers.append(LayerAttention(int(kv_heads[layer]), full_head_dim, rope=full_rope))
    names = meta.tensor_names
    full = kinds.index("full_attention") if "full_attention" in kinds else None
    values_from_keys = full is not None and f"blk.{full}.attn_v.weight" not in names
    moe = None
    if "blk.0.ffn_gate_inp.weight" in names:
        try:
            moe = MoEConfig(num_experts=int(meta.get("expert_count")), top_k=int(meta.get("expert_used_count")),
                            intermediate_size=int(meta.get("expert_feed_forward_length")), router="softmax_topk",
                            normalize=True)
        except TypeError:
            raise ModelConfigError(f"{meta.source}: a gemma4 file with experts needs gemma4.expert_count, "
                                   "expert_used_count and expert_feed_forward_length") from None
    softcap = meta.get("final_logit_softcapping")
    gemma = GemmaOptions(value_norm=True, values_from_keys=values_from_keys, layer_scale=True,
                         moe_beside_mlp=moe is not None)
    return ModelConfig(architecture="Gemma4ForCausalLM", **fields | {"qk_norm": True}, layer_attention=tuple(layers),
                       attention_scale=1.0, hidden_act="gelu_tanh", embedding_scale=fields["hidden_size"] ** 0.5,
                       final_logit_softcap=None if softcap is None else float(softcap), gemma=gemma, moe=moe)


# Gemma 4's mixture-of-experts and layer tensors in llama.cpp's names (kind, suffix) -> ours after
# `model.layers.N.`; the router's scales ride on other tensors' names there.
GEMMA4_GGUF_TENSORS = {
    ("ffn_gate_inp", "weight"): "router.proj.weight",
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",
    ("ffn_down_exps", "weight"): "experts.down_proj",
    ("ffn_gate_exps", "weight"): "experts.gate_proj",
    ("ffn_up_exps", "weight"): "experts.up_proj",
    ("layer_output_scale", "weight"): "layer_scalar",
}


@dataclasses.dataclass(frozen=True)
class Gemma4Family(Family):
    """Gemma 4's GGUF names first (its router and expert tensors are not the common mixture's)."""

    def gguf_targets(self, gguf_name: str, config: ModelConfig) -> list[Target] | None:
        parts = gguf_name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
            prefix, key = f"model.layers.{parts[1]}.", (parts[2], parts[3])
            if key in GEMMA4_GGUF_TENSORS:
                return [Target(prefix + GEMMA4_GGUF_TENSORS[key])]
            if key == ("ffn_gate_up_exps", "weight"):
                size = config.moe.intermediate_size
                return split_rows([prefix + "experts.gate_proj", prefix + "experts.up_proj"], [size, size], axis=1)
        return super().gguf_targets(gguf_name, config)


FAMILY = Gemma4Family(name="gemma4", model_class=Gemma4ForCausalLM, hf_config=hf_config, gguf_config=gguf_config,
                      hf_targets=hf_targets, layer_tensors=GEMMA4_LAYER_TENSORS)
