"""Whether a model is an embedding model, and how it pools: read from its folder or its GGUF metadata.

A Hugging Face folder says it through sentence-transformers' files: `modules.json` lists the modules
(Transformer, Pooling, Normalize, ...); the Pooling module's `config.json` (`1_Pooling/config.json`)
sets one `pooling_mode_*` flag; a `Normalize` module means L2 normalisation. A GGUF says it in
`<arch>.pooling_type` (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank); llama.cpp's server
normalises embeddings by default, so a GGUF embedding model is taken as normalised.

Qwen3's embedding models (last-token pooling, normalised, Qwen3 architecture) are trained for Matryoshka
truncation: a client may ask them for fewer dimensions. No file records that, so the rule is stated here.
"""

from __future__ import annotations

import json
from pathlib import Path

from localserve.models.pooling import PoolingMethod, PoolingSpec

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# The pooling_mode_* flags this project pools by; the others (max, mean_sqrt_len, weightedmean) are refused.
POOLING_MODES = {"pooling_mode_lasttoken": PoolingMethod.LAST, "pooling_mode_mean_tokens": PoolingMethod.MEAN,
                 "pooling_mode_cls_token": PoolingMethod.CLS}
GGUF_POOLING_TYPES = {1: PoolingMethod.MEAN, 2: PoolingMethod.CLS, 3: PoolingMethod.LAST}
MATRYOSHKA_ARCHITECTURES = ("Qwen3ForCausalLM",)


class PoolingConfigError(ValueError):
    """An embedding model whose pooling this project cannot do; the message names the file."""


def folder_pooling(folder: Path, architecture: str) -> PoolingSpec | None:
    """The pooling a folder's sentence-transformers config names; None when it has none (a generation model)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise PoolingConfigError(f"{modules_file}: expected a list of module objects")
    types = [module.get("type") for module in modules]
    pooling = next((module for module in modules if module.get("type") == POOLING_MODULE), None)
    if pooling is None:
        return None
    config_file = folder / str(pooling.get("path", "1_Pooling")) / "config.json"
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise PoolingConfigError(f"{config_file}: expected an object of pooling_mode_* flags")
    chosen = [name for name, value in config.items() if name.startswith("pooling_mode_") and value is True]
    if len(chosen) != 1 or chosen[0] not in POOLING_MODES:
        raise PoolingConfigError(f"{config_file}: pooling modes {chosen or 'none'} set; supported: exactly one of "
                                 f"{', '.join(POOLING_MODES)}")
    return _spec(POOLING_MODES[chosen[0]], NORMALIZE_MODULE in types, architecture)


def gguf_pooling(pooling_type: int | None, architecture: str, source: str) -> PoolingSpec | None:
    """The pooling of a GGUF's `<arch>.pooling_type` value; None when absent or 0 (a generation model)."""
    if not pooling_type:
        return None
    if pooling_type not in GGUF_POOLING_TYPES:
        raise PoolingConfigError(f"{source}: pooling_type {pooling_type} is not supported (1 mean, 2 cls, 3 last)")
    return _spec(GGUF_POOLING_TYPES[pooling_type], True, architecture)


def _spec(method: PoolingMethod, normalize: bool, architecture: str) -> PoolingSpec:
    truncatable = normalize and method is PoolingMethod.LAST and architecture in MATRYOSHKA_ARCHITECTURES
    return PoolingSpec(method, normalize, truncatable)


def _read_json(path: Path):
    if not path.is_file():
        raise PoolingConfigError(f"{path}: missing file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PoolingConfigError(f"{path}: invalid JSON ({exc})") from None
