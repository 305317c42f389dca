"""A model's shapes and weight size from its metadata alone (a config.json, a model folder, a .gguf's header),
for `localserve plan`: no weight is read."""

from __future__ import annotations

import json
from pathlib import Path

from localserve.kv.memory_plan import human_size
from localserve.loading.default_model import resolve_default_model
from localserve.loading.model_card import parameter_count
from localserve.models.config import ModelConfig
from localserve.models.registry import config_from_hf


def estimated_weight_bytes(config: ModelConfig, bytes_per_param: float = 2.0) -> int:
    """Weights of a model from its shapes (16-bit by default), every expert of a mixture of experts
    resident; for a bare config.json."""
    return int(parameter_count(config) * bytes_per_param)


def load_plan_model(model: str | None, bytes_per_param: float = 2.0,
                    keep_quantized_weights: bool = True) -> tuple[ModelConfig, int, str]:
    """(config, weight bytes once loaded, how they were counted) for a config.json, an HF folder or a .gguf
    file; None: the default model.

    Reads only metadata. Weights count at `bytes_per_param` (bf16 on a GPU), except a GGUF's tensors
    that --keep-quantized-weights keeps in their blocks, which count at their stored size (the loader's
    own rule, `keeps_quantized`).
    """
    path = resolve_default_model() if model is None else Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    dense = f"parameters x {bytes_per_param:g} bytes"
    if path.is_file() and path.suffix == ".json":
        name = path.parent.name if path.name == "config.json" else path.stem
        config = config_from_hf(json.loads(path.read_text()), name=name, source=str(path))
        return config, estimated_weight_bytes(config, bytes_per_param), dense
    if path.is_file() and path.suffix == ".gguf":
        from localserve.loading.gguf import gguf_model_config, gguf_weight_bytes, open_gguf  # imports torch

        reader = open_gguf(path)
        config = gguf_model_config(path, reader)
        stored, dense_bytes = gguf_weight_bytes(reader, config, bytes_per_param)
        if keep_quantized_weights and stored < dense_bytes:
            return config, stored, f"stored size, quantized blocks kept; {human_size(dense_bytes)} at {dense}"
        return config, dense_bytes, dense
    raise ValueError(f"{model}: not a config.json, a model folder or a .gguf file")
