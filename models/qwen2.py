"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`; GGUF `qwen2`): the plain decoder with biases on Q, K and V."""

from __future__ import annotations

from typing import Any

from localserve.models.config import LayerAttention, ModelConfig, hf_decoder_fields
from localserve.models.family import Family, GGUFMetadata, gguf_decoder_fields
from localserve.models.layers.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """The shared decoder under the name its checkpoints declare (what logs and reports show); the family's
    differences are in its config reading and tensor names, not in code."""

def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    """transformers' reading: with `use_sliding_window`, the layers `layer_types` names "sliding_attention"
    (by default those from `max_window_layers` on) see the last `sliding_window` keys, the others all."""
    fields = hf_decoder_fields(config, source) | {"qkv_bias": True}
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    num_layers = fields["num_layers"]
    layer_types = config.get("layer_types") or [
        "sliding_attention" if window is not None and layer >= config.get("max_window_layers", 28)
        else "full_attention" for layer in range(num_layers)]
    windows = [window if kind == "sliding_attention" else None for kind in layer_types]
    if len(set(windows)) == 1:  # every layer alike: the model-wide field
        return ModelConfig(architecture="Qwen2ForCausalLM", **fields, sliding_window=windows[0])
    layers = tuple(LayerAttention(fields["num_kv_heads"], fields["head_dim"], layer_window,
                                  rotary_dim=fields.get("rotary_dim")) for layer_window in windows)
    return ModelConfig(architecture="Qwen2ForCausalLM", **fields, layer_attention=layers)

def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    return ModelConfig(architecture="Qwen2ForCausalLM", **gguf_decoder_fields(meta))

FAMILY = Family(name="qwen2", model_class=Qwen2ForCausalLM, hf_config=hf_config, gguf_config=gguf_config)
