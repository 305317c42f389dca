"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`; GGUF `qwen2`): the plain decoder with biases on Q, K and V."""

from __future__ import annotations

from typing import Any

from localserve.models.config import ModelConfig, hf_decoder_fields
from localserve.models.family import Family, GGUFMetadata, gguf_decoder_fields
from localserve.models.layers.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """The shared decoder under the name its checkpoints declare (what logs and reports show); the family's
    differences are in its config reading and tensor names, not in code."""

def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    fields = hf_decoder_fields(config, source) | {"qkv_bias": True}
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    return ModelConfig(architecture="Qwen2ForCausalLM", **fields, sliding_window=window)

def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    return ModelConfig(architecture="Qwen2ForCausalLM", **gguf_decoder_fields(meta))

FAMILY = Family(name="qwen2", model_class=Qwen2ForCausalLM, hf_config=hf_config, gguf_config=gguf_config)
