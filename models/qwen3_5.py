"""Qwen3.5 / Qwen3.6 dense models (`Qwen3_5ForConditionalGeneration`, `Qwen3_5ForCausalLM`; model types
`qwen3_5`, `qwen3_5_text`): the hybrid decoder (models/layers/hybrid.py).

`layer_types` says which layers are Gated DeltaNet (`linear_attention`) and which attend (`full_attention`);
without it, every `full_attention_interval`-th layer (4) attends. The linear layers' shapes:
`linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`, `linear_value_head_dim`,
`linear_conv_kernel_dim`. Rotary embedding on the first `partial_rotary_factor` (0.25) of each head, from
`rope_parameters` (or the config's top level); its multimodal sections (`mrope_section`, [11, 11, 10] when
not given, interleaved as transformers' Qwen3.5 does) turn text positions all alike, so text uses plain
positions and an image's tokens their 3D ones (engine/mrope.py).

A multimodal checkpoint (`Qwen3_5ForConditionalGeneration`: `model.language_model.*`, `model.visual.*`)
loads its language model here, without the vision tower (loaded apart: models/vision/qwen3_5_encoder.py)
and the multi-token prediction layers (`mtp.*`) some checkpoints carry. The shared readers here serve the MoE
variant (models/qwen3_5_moe.py) and Qwen3-Next (models/qwen3_next.py) too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from localserve.models.config import (
    LayerAttention,
    LinearAttentionConfig,
    ModelConfig,
    ModelConfigError,
    MoEConfig,
    hf_decoder_fields,
)
from localserve.models.family import Family, Target
from localserve.models.layers.attention import check_layers
from localserve.models.layers.hybrid import HybridForCausalLM
from localserve.models.qwen3_5_gguf import gguf_config, gguf_layer_targets
from localserve.models.qwen3_moe import hf_targets as expert_targets

LAYER_TYPES = ("linear_attention", "full_attention")
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25  # transformers' default for these configs
DEFAULT_MROPE_SECTION = (11, 11, 10)  # transformers' Qwen3.5 text rotary's default
# A multimodal checkpoint's prefixes -> ours; tensors under UNLOADED_PREFIXES are not read.
LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                           "language_model.lm_head.": "lm_head."}
UNLOADED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


class Qwen3_5ForCausalLM(HybridForCausalLM):
    """The hybrid decoder under the name its checkpoints declare (what logs and reports show)."""


def layer_types_of(text: dict[str, Any], num_layers: int, source: str) -> list[str]:
    """Each layer's kind: `layer_types`, else every `full_attention_interval`-th layer full; ModelConfigError
    names a wrong length, an unknown entry, or a model without any full-attention layer."""
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ModelConfigError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    for layer, kind in enumerate(layer_types):
        if kind not in LAYER_TYPES:
            raise ModelConfigError(f"{source}: layer {layer}'s type {kind!r} in layer_types is not one of "
                                   f"{', '.join(LAYER_TYPES)}")
    if "full_attention" not in layer_types:
        raise ModelConfigError(f"{source}: layer_types has no full_attention layer; this project serves hybrid "
                               "models with at least one")
    return list(layer_types)


def linear_attention_of(text: dict[str, Any], source: str, fused: bool = False) -> LinearAttentionConfig:
    try:
        return LinearAttentionConfig(
            num_key_heads=int(text["linear_num_key_heads"]), num_value_heads=int(text["linear_num_value_heads"]),
            key_head_dim=int(text["linear_key_head_dim"]), value_head_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)), fused_qkvz=fused, fused_ba=fused)
    except KeyError as exc:
        raise ModelConfigError(f"{source}: missing field {exc.args[0]!r}") from None
    except ModelConfigError as exc:
        raise ModelConfigError(f"{source}: {exc}") from None


def rotary_dim_of(text: dict[str, Any], head_dim: int, source: str) -> int:
    """The rotated width of each head: `partial_rotary_factor` (in `rope_parameters`, `rope_scaling` or at the
    top level; 0.25 when none says) of the head, an even number of values."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    rotary_dim = int(head_dim * float(factor))
    if not 0 < float(factor) <= 1 or rotary_dim < 2 or rotary_dim % 2:
        raise ModelConfigError(f"{source}: partial_rotary_factor {factor!r} of head_dim {head_dim} gives "
                               f"{rotary_dim} rotated values; need an even number from 2 to the head size")
    return rotary_dim


def mrope_section_of(text: dict[str, Any], source: str) -> tuple[int, int, int]:
    """The multimodal rotary sections (temporal, height, width frequencies) of a Qwen3.5 text config."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    sections = params.get("mrope_section", text.get("mrope_section", DEFAULT_MROPE_SECTION))
    if (not isinstance(sections, (list, tuple)) or len(sections) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sections)):
        raise ModelConfigError(f"{source}: mrope_section must be 3 non-negative integers (temporal, height, "
                               f"width); got {sections!r}")
    return tuple(sections)


def hybrid_config(config: dict[str, Any], source: str, architecture: str, moe: MoEConfig | None = None,
                  fused: bool = False) -> ModelConfig:
    """A hybrid model's ModelConfig from its config dict (its `text_config` where it has one)."""
    text = dict(config.get("text_config") or config)
    if moe is not None:
        text.setdefault("intermediate_size", 0)  # every layer's MLP is a mixture of experts
    fields = hf_decoder_fields(text, source) | {"qk_norm": True}
    if "text_config" in config:
        # A multimodal config's own tie_word_embeddings and token ids, where it has them, rule.
        fields["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", fields["tie_word_embeddings"]))
        if not fields["eos_token_ids"] and config.get("eos_token_id") is not None:
            eos = config["eos_token_id"]
            fields["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
    if not text.get("attn_output_gate", True):
        raise ModelConfigError(f"{source}: attn_output_gate false is not supported (the full-attention layers' "
                               "q_proj carries their output gate)")
    activation = text.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelConfigError(f"{source}: hidden_act {activation!r} is not supported (silu)")
    layer_types = layer_types_of(text, fields["num_layers"], source)
    linear = linear_attention_of(text, source, fused)
    rotary_dim = rotary_dim_of(text, fields["head_dim"], source)
    layers = tuple(LayerAttention(fields["num_kv_heads"], fields["head_dim"], rotary_dim=rotary_dim,
                                  state=linear.state if kind == "linear_attention" else None)
                   for kind in layer_types)
    if architecture.startswith("Qwen3_5"):  # Qwen3.5 / 3.6 (not Qwen3-Next): images' 3D positions
        fields["rope"] = replace(fields["rope"], mrope_section=mrope_section_of(text, source))
    unloaded = ("vision tower",) if "vision_config" in config else ()  # the language model's load leaves it
    if text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers"):
        unloaded += ("multi-token prediction layers",)
    read = ModelConfig(architecture=architecture, **fields, moe=moe, rotary_dim=rotary_dim,
                       layer_attention=layers, linear_attention=linear, unloaded_parts=unloaded)
    check_layers(read, source)
    return read


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    return hybrid_config(config, source, config["architectures"][0])


def hf_targets(name: str, config: ModelConfig) -> list[Target] | None:
    """A multimodal checkpoint's language model under our names; vision and MTP tensors skipped; stacked
    or per-expert experts (a mixture of experts) as Qwen3-MoE stores them."""
    if name.startswith(UNLOADED_PREFIXES):
        return []
    for prefix, ours in LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            name = ours + name.removeprefix(prefix)
            break
    if config.moe is not None:
        targets = expert_targets(name, config)
        if targets is not None:
            return targets
    return [Target(name)]


FAMILY = Family(name="qwen3_5", model_class=Qwen3_5ForCausalLM, hf_config=hf_config, hf_targets=hf_targets,
                gguf_config=gguf_config, gguf_layer_targets=gguf_layer_targets)
