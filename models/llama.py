"""Llama 2/3/3.x, SmolLM2 and Mistral (`LlamaForCausalLM`, `MistralForCausalLM`; GGUF `llama`): the plain
decoder of models/layers/decoder.py. llama.cpp's converter interleaves the rotary halves of Q and K in
this family's GGUFs; the loader puts them back (whole rows, so quantized blocks move as they are)."""

from __future__ import annotations

from typing import Any

from localserve.models.config import ModelConfig, hf_decoder_fields
from localserve.models.family import Family, GGUFMetadata, gguf_decoder_fields
from localserve.models.layers.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """The Llama decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, tied or untied embeddings."""


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    architecture = config["architectures"][0]
    # Mistral's configs name a sliding window they use unless told not to; Llama's never use one.
    use_window = config.get("use_sliding_window", architecture == "MistralForCausalLM")
    return ModelConfig(architecture=architecture, **hf_decoder_fields(config, source),
                       sliding_window=config.get("sliding_window") if use_window else None)


def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", **gguf_decoder_fields(meta))


FAMILY = Family(name="llama", model_class=LlamaForCausalLM, hf_config=hf_config, gguf_config=gguf_config,
                unpermute_rotary=True)
