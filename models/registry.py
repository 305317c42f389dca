"""Model families by name, imported lazily: a Hugging Face config's `architectures` (or, failing those,
its `model_type`) or a GGUF's `general.architecture` -> the family file (models/<family>.py) that serves it.

A new family is one file defining `FAMILY` (models/family.py) plus its names in the tables below.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from localserve.models.config import ModelConfig, ModelConfigError

if TYPE_CHECKING:
    from localserve.models.family import Family, GGUFMetadata

# Hugging Face `architectures` -> family module
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Mistral3ForConditionalGeneration": "mistral3",
    "Ministral3ForCausalLM": "mistral3",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# Hugging Face `model_type` -> family module, for a config that names no architecture we know
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                  "phi3": "phi3", "mistral3": "mistral3", "ministral3": "mistral3", "gpt_oss": "gpt_oss",
                  "gemma3_text": "gemma3", "gemma3": "gemma3", "gemma4_text": "gemma4", "gemma4": "gemma4",
                  "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
                  "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}
# GGUF `general.architecture` -> family module
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "phi3": "phi3",
                      "mistral3": "mistral3", "gpt-oss": "gpt_oss", "gemma3": "gemma3", "gemma4": "gemma4",
                      "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}


def family(name: str) -> Family:
    """The family defined in models/<name>.py."""
    return importlib.import_module(f"localserve.models.{name}").FAMILY


def hf_family(config: dict[str, Any], source: str) -> tuple[Family, str]:
    """The family of a Hugging Face config and the architecture name it goes by; ModelConfigError lists the
    supported architectures when it names none of them."""
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in HF_ARCHITECTURES:
            return family(HF_ARCHITECTURES[architecture]), architecture
    model_type = config.get("model_type")
    if not architectures and model_type in HF_MODEL_TYPES:
        found = family(HF_MODEL_TYPES[model_type])
        return found, found.name
    raise ModelConfigError(f"{source}: unsupported architecture {architectures or model_type!r}; "
                           f"supported: {', '.join(HF_ARCHITECTURES)}")


def config_from_hf(config: dict[str, Any], name: str = "model", source: str = "config.json") -> ModelConfig:
    """A Hugging Face config dict read by its family."""
    found, architecture = hf_family(config, source)
    read = found.hf_config(config | {"architectures": [architecture]}, source)
    return dataclasses.replace(read, name=name, family=found.name)


def gguf_family(meta: GGUFMetadata) -> Family:
    """The family of a GGUF's `general.architecture`; ModelConfigError lists the supported ones."""
    if meta.architecture not in GGUF_ARCHITECTURES:
        raise ModelConfigError(f"{meta.source}: unsupported architecture {meta.architecture!r}; supported: "
                               f"{', '.join(GGUF_ARCHITECTURES)}")
    found = family(GGUF_ARCHITECTURES[meta.architecture])
    if found.gguf_config is None:
        raise ModelConfigError(f"{meta.source}: the {found.name} family reads no GGUF files")
    return found
