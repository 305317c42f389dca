"""gpt-oss: gpt-oss-20b, gpt-oss-120b (`GptOssForCausalLM`; GGUF `gpt-oss`).

A decoder whose layers alternate a sliding window (`layer_types`: `sliding_attention`, or
`full_attention`; llama.cpp's GGUFs: even layers windowed) with full attention; every attention layer has
biases on q/k/v/o and a learned sink logit per head (`self_attn.sinks`) in its softmax's denominator.
Rotary: YaRN, its correction range kept exact (`truncate: false`). Each MLP is a mixture of experts: the
router (with a bias) takes the top k logits and softmaxes them; each expert has biases and the clamped
SwiGLU (MoEConfig.activation `clamped_swiglu`: `swiglu_alpha`, `swiglu_limit`; llama.cpp's fixed 1.702
and 7.0 for a GGUF).

Hugging Face checkpoints fuse each expert's gate and up projections, their rows interleaved (gate 0, up 0,
gate 1, ...): as dense tensors stored input-major (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H], as
transformers saves a random one), or as the released checkpoints' MXFP4 pairs (`gate_up_proj_blocks` [E,
2I, H / 32, 16] with `_scales`, output-major; loading/mxfp4.py). llama.cpp's GGUFs hold gate and up
apart, MXFP4 as released.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from localserve.models.config import LayerAttention, ModelConfig, ModelConfigError, MoEConfig, hf_decoder_fields
from localserve.models.family import DECODER_LAYER_TENSORS, Family, GGUFMetadata, Target, gguf_decoder_fields
from localserve.models.layers.attention import check_layers
from localserve.models.layers.decoder import DecoderForCausalLM

LAYER_TYPES = ("sliding_attention", "full_attention")


class GptOssForCausalLM(DecoderForCausalLM):
    """The shared decoder under the name its checkpoints declare: windows, sinks, biases and the experts'
    activation come from its config (ModelConfig.layer_attention, attention_sinks, MoEConfig), not code."""


def layer_windows(layer_types: list[Any], num_layers: int, window: Any, source: str) -> tuple[LayerAttention, ...]:
    """(num_kv_heads and head_dim filled by the caller) each layer's window from its type; ModelConfigError
    names the layer and the value a kernel cannot take."""
    if len(layer_types) != num_layers:
        raise ModelConfigError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    layers = []
    for layer, kind in enumerate(layer_types):
        if kind not in LAYER_TYPES:
            raise ModelConfigError(f"{source}: layer {layer}'s type {kind!r} in layer_types is not one of "
                                   f"{', '.join(LAYER_TYPES)}")
        if kind == "full_attention":
            layers.append(LayerAttention(0, 0))
            continue
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ModelConfigError(f"{source}: layer {layer} is a sliding_attention layer but sliding_window "
                                   f"{window!r} is no positive whole number of tokens")
        layers.append(LayerAttention(0, 0, sliding_window=window))
    return tuple(layers)


def _with_layers(fields: dict[str, Any], layers: tuple[LayerAttention, ...]) -> tuple[LayerAttention, ...]:
    return tuple(dataclasses.replace(layer, num_kv_heads=fields["num_kv_heads"], head_dim=fields["head_dim"])
                 for layer in layers)


def _moe(num_experts: Any, top_k: Any, intermediate_size: Any, alpha: Any, limit: Any) -> MoEConfig:
    return MoEConfig(num_experts=int(num_experts), top_k=int(top_k), intermediate_size=int(intermediate_size),
                     router="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
                     swiglu_alpha=float(alpha), swiglu_limit=float(limit))


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    fields = hf_decoder_fields(config, source)
    num_layers = fields["num_layers"]
    layer_types = config.get("layer_types") or [
        "sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(num_layers)]
    try:
        moe = _moe(config.get("num_local_experts") or config["num_experts"], config["num_experts_per_tok"],
                   config["intermediate_size"], config.get("swiglu_alpha", 1.702), config.get("swiglu_limit", 7.0))
    except KeyError as exc:
        raise ModelConfigError(f"{source}: missing field {exc.args[0]!r}") from None
    except ModelConfigError as exc:
        raise ModelConfigError(f"{source}: {exc}") from None
    layers = _with_layers(fields, layer_windows(layer_types, num_layers, config.get("sliding_window"), source))
    read = ModelConfig(architecture="GptOssForCausalLM", **fields, moe=moe, layer_attention=layers,
                       attention_sinks=True)
    check_layers(read, source)
    return read


# transformers' expert and router names -> ours (after `model.layers.N.mlp.`): (name, first row, step along
# `axis`, transposed); rows None: the whole tensor.
EXPERT_PARTS = {
    "router.weight": [("gate.weight", None, 0, False)],
    "router.bias": [("gate.bias", None, 0, False)],
    "experts.gate_up_proj": [("experts.gate_proj", 0, 2, True), ("experts.up_proj", 1, 2, True)],
    "experts.gate_up_proj_bias": [("experts.gate_bias", 0, 1, False), ("experts.up_bias", 1, 1, False)],
    "experts.gate_up_proj_blocks": [("experts.gate_proj", 0, 1, False), ("experts.up_proj", 1, 1, False)],
    "experts.down_proj": [("experts.down_proj", None, 0, True)],
    "experts.down_proj_bias": [("experts.down_bias", None, 0, False)],
    "experts.down_proj_blocks": [("experts.down_proj", None, 0, False)],
}


def hf_targets(name: str, config: ModelConfig) -> list[Target] | None:
    stem, found, part = name.partition(".mlp.")
    if not found or part not in EXPERT_PARTS:
        return None
    targets = []
    for ours, first, axis, transpose in EXPERT_PARTS[part]:
        rows = None if first is None else (first, 2 * config.moe.intermediate_size)
        targets.append(Target(f"{stem}.mlp.{ours}", rows, axis, step=1 if rows is None else 2, transpose=transpose))
    return targets


def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    fields = gguf_decoder_fields(meta)
    fields["rope"] = dataclasses.replace(fields["rope"], truncate=False)
    num_layers = fields["num_layers"]
    # llama.cpp windows the even layers of a gpt-oss (its swa pattern of 2), as transformers' default
    pattern = meta.get("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == num_layers:
        layer_types = ["sliding_attention" if windowed else "full_attention" for windowed in pattern]
    else:
        layer_types = ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(num_layers)]
    window = meta.get("attention.sliding_window")
    layers = _with_layers(fields, layer_windows(layer_types, num_layers, None if window is None else int(window),
                                                meta.source))
    try:
        moe = _moe(meta.get("expert_count"), meta.get("expert_used_count"),
                   meta.get("expert_feed_forward_length"), 1.702, 7.0)
    except TypeError:
        raise ModelConfigError(f"{meta.source}: a {meta.architecture} file needs {meta.architecture}.expert_count, "
                               "expert_used_count and expert_feed_forward_length") from None
    except ModelConfigError as exc:
        raise ModelConfigError(f"{meta.source}: {exc}") from None
    read = ModelConfig(architecture="GptOssForCausalLM", **fields, moe=moe, layer_attention=layers,
                       attention_sinks=True)
    check_layers(read, meta.source)
    return read


def gguf_layer_targets(kind: str, suffix: str, prefix: str, config: ModelConfig) -> list[Target] | None:
    if kind == "attn_sinks":  # llama.cpp names the [H] sinks `attn_sinks.weight`
        return [Target(f"{prefix}self_attn.sinks")]
    return None


FAMILY = Family(name="gpt_oss", model_class=GptOssForCausalLM, hf_config=hf_config, gguf_config=gguf_config,
                layer_tensors=DECODER_LAYER_TENSORS | {"post_attention_norm": "post_attention_layernorm"},
                hf_targets=hf_targets, gguf_layer_targets=gguf_layer_targets)
