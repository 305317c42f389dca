"""Mistral Small 3.x, Devstral, Magistral and Ministral 3 as text models (`Mistral3ForConditionalGeneration`
with a `mistral` or `ministral3` text config, `Ministral3ForCausalLM`; GGUF `mistral3`): the plain decoder.

A multimodal checkpoint's language model is served alone: its vision tower and projector are left unloaded
(the loader says so at start). Ministral 3's yarn takes its attention factor from two mscales, and its
queries grow with the position past the original context (`llama_4_scaling_beta`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from localserve.models.config import ModelConfig, hf_decoder_fields
from localserve.models.family import Family, GGUFMetadata, Target, gguf_decoder_fields
from localserve.models.layers.decoder import DecoderForCausalLM

# A multimodal checkpoint's prefixes (transformers 5's, then earlier ones) -> the decoder's
LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                           "language_model.lm_head.": "lm_head."}
UNLOADED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Mistral3ForCausalLM(DecoderForCausalLM):
    """The shared decoder under the name its checkpoints declare (what logs and reports show); the family's
    differences are in its config reading and tensor names, not in code."""


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    text = config.get("text_config") or config
    fields = hf_decoder_fields(text, source)
    # A multimodal config's own tie_word_embeddings, where it has one, rules (transformers ties by it).
    fields["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", fields["tie_word_embeddings"]))
    window = text.get("sliding_window") if text.get("use_sliding_window", True) else None
    unloaded = ("vision tower", "multimodal projector") if "vision_config" in config else ()
    return ModelConfig(architecture=config["architectures"][0], **fields, sliding_window=window,
                       unloaded_parts=unloaded)


def hf_targets(name: str, config: ModelConfig) -> list[Target] | None:
    if name.startswith(UNLOADED_PREFIXES):
        return []
    for prefix, ours in LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return [Target(ours + name.removeprefix(prefix))]
    return None


def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    fields = gguf_decoder_fields(meta)
    rope = fields["rope"]
    if meta.get("rope.scaling.yarn_log_multiplier") is not None and rope.attention_factor is None:
        # llama.cpp keeps Ministral 3's mscale_all_dim alone; its mscale is the same (1), so the factor is 1
        rope = dataclasses.replace(rope, attention_factor=1.0)
    beta = meta.get("attention.temperature_scale")
    if beta is not None:
        rope = dataclasses.replace(rope, query_scale_beta=float(beta))
    return ModelConfig(architecture="Mistral3ForConditionalGeneration", **fields | {"rope": rope})


FAMILY = Family(name="mistral3", model_class=Mistral3ForCausalLM, hf_config=hf_config, gguf_config=gguf_config,
                hf_targets=hf_targets, unpermute_rotary=True)
