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

MXFP4_BYTES_PER_VALUE = 17 / 32  # a block of 32 four-bit values and one shared exponent byte


def estimated_weight_bytes(config: ModelConfig, bytes_per_param: float = 2.0, mxfp4_experts: bool = False) -> int:
    """Weights of a model from its shapes (16-bit by default), every expert of a mixture of experts
    resident; for a bare config.json. `mxfp4_experts`: the routed experts' gate, up and down projections
    count at MXFP4's stored size, as the loader keeps a folder's MXFP4 experts on a GPU."""
    total = parameter_count(config)
    if not mxfp4_experts or config.moe is None:
        return int(total * bytes_per_param)
    moe_layers = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    experts = moe_layers * config.moe.num_experts * 3 * config.hidden_size * config.moe.intermediate_size
    return int((total - experts) * bytes_per_param + experts * MXFP4_BYTES_PER_VALUE)


def _says_mxfp4(raw: dict) -> bool:
    """Whether a config.json's `quantization_config` stores its experts in MXFP4 (gpt-oss's releases)."""
    quantization = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config") or {}
    return quantization.get("quant_method") == "mxfp4"


def load_plan_model(model: str | None, bytes_per_param: float = 2.0,
                    keep_quantized_weights: bool = True) -> tuple[ModelConfig, int, str]:
    """(config, weight bytes once loaded, how they were counted) for a config.json, an HF folder or a .gguf
    file; None: the default model.

    Reads only metadata. Weights count at `bytes_per_param` (bf16 on a GPU), except what
    --keep-quantized-weights keeps in its blocks, which counts at its stored size: a GGUF's quantized
    tensors (the loader's own rule, `keeps_quantized`) and the MXFP4 experts of a folder whose config says
    `quant_method: mxfp4`.
    """
    path = resolve_default_model() if model is None else Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    dense = f"parameters x {bytes_per_param:g} bytes"
    if path.is_file() and path.suffix == ".json":
        name = path.parent.name if path.name == "config.json" else path.stem
        raw = json.loads(path.read_text())
        config = config_from_hf(raw, name=name, source=str(path))
        if keep_quantized_weights and config.moe is not None and _says_mxfp4(raw):
            dense_bytes = estimated_weight_bytes(config, bytes_per_param)
            return (config, estimated_weight_bytes(config, bytes_per_param, mxfp4_experts=True),
                    f"MXFP4 experts kept in their blocks; {human_size(dense_bytes)} at {dense}")
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
