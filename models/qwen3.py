"""Qwen3 dense models and Qwen3 embedding models (`Qwen3ForCausalLM`; GGUF `qwen3`): the plain decoder with
an RMSNorm on every query and key head."""

from __future__ import annotations

from typing import Any

from localserve.models.config import ModelConfig, hf_decoder_fields
from localserve.models.family import Family, GGUFMetadata, gguf_decoder_fields
from localserve.models.layers.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """The shared decoder under the name its checkpoints declare (what logs and reports show); the family's
    differences are in its config reading and tensor names, not in code."""


def qwen3_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen3's decoder fields (also Qwen3-MoE's): q/k norm; `attention_bias` on Q, K, V only."""
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    return hf_decoder_fields(config, source) | {"qk_norm": True, "o_bias": False, "sliding_window": window}


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", **qwen3_fields(config, source))


def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    return ModelConfig(architecture="Qwen3ForCausalLM", **gguf_decoder_fields(meta))


FAMILY = Family(name="qwen3", model_class=Qwen3ForCausalLM, hf_config=hf_config, gguf_config=gguf_config)
