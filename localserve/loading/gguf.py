"""Read a .gguf file: model config from its metadata, weights tensor by tensor, dequantized or kept in
their quantized blocks.

The file's `general.architecture` names its family (models/registry.py), which reads the config and says
where each GGUF tensor goes (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; a fused
tensor to several parameters; llama.cpp's interleaved Q/K rotary halves put back for the `llama` family).
Every tensor's type and shape are checked against the model before anything is allocated. With
`keep_quantized`, every linear, embedding and expert weight of a type the kernels read (QUANT_FORMATS)
stays as its blocks (`QuantizedTensor`); everything else is dequantized.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from localserve.kernels.gguf_blocks import QUANT_FORMATS
from localserve.loading.pieces import same_values, take, unpermute_rotary
from localserve.loading.pooling_config import PoolingConfigError, gguf_pooling
from localserve.models.config import ModelConfig, ModelConfigError
from localserve.models.family import Family, Target
from localserve.models.layers.linear import QuantizedTensor
from localserve.models.registry import family, gguf_family

__all__ = ["GGUFLoadError", "gguf_model_config", "iter_gguf_weights", "open_gguf", "unpermute_rotary"]
DENSE_TYPES = ("F32", "F16", "BF16")


class GGUFLoadError(RuntimeError):
    """A .gguf file that cannot be loaded; the message names the file and the problem."""


def open_gguf(path: Path):  # -> gguf.GGUFReader
    """Open a GGUF file, turning the reader's low-level failures into one clear error."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except ValueError as exc:
        match = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
        if match:
            raise GGUFLoadError(f"{path}: a tensor has unknown GGML type {match.group(1)} "
                                f"(gguf {importlib.metadata.version('gguf')} does not know it)") from None
        raise GGUFLoadError(f"{path}: cannot read GGUF ({exc})") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


class ReaderMetadata:
    """A GGUFReader's metadata as a family reads it (models/family.py's `GGUFMetadata`)."""

    def __init__(self, reader, path: Path) -> None:
        self.reader = reader
        self.source = str(path)
        self.architecture = _field(reader, "general.architecture")

    @cached_property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.reader.tensors)

    def get(self, key: str, default: Any = None) -> Any:
        return _field(self.reader, f"{self.architecture}.{key}", default)

    def general(self, key: str, default: Any = None) -> Any:
        return _field(self.reader, key, default)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(name).shape))

    def tensor_values(self, name: str) -> Sequence[float]:
        return np.asarray(self._tensor(name).data, dtype=np.float32).tolist()

    def _tensor(self, name: str):
        return next(t for t in self.reader.tensors if t.name == name)


def gguf_model_config(path: Path, reader=None) -> ModelConfig:
    """Build the ModelConfig from a GGUF's metadata (`reader`: an already open GGUFReader of `path`)."""
    meta = ReaderMetadata(reader or open_gguf(path), path)
    found = gguf_family(meta)
    config = found.gguf_config(meta)
    try:
        pooling = gguf_pooling(meta.get("pooling_type"), config.architecture, str(path))
    except PoolingConfigError as exc:
        raise ModelConfigError(str(exc)) from None
    return dataclasses.replace(config, name=Path(path).stem, family=found.name, pooling=pooling)


def tensor_targets(tensor, found: Family, config: ModelConfig, path: Path) -> list[Target]:
    """Where a GGUF tensor goes in the model; GGUFLoadError for one the family does not know."""
    targets = found.gguf_targets(tensor.name, config)
    if targets is None:
        raise GGUFLoadError(f"{path}: unexpected tensor {tensor.name!r} for {found.name}")
    return targets


def keeps_quantized(tensor, targets: list[Target]) -> bool:
    """Whether a GGUF tensor (a ReaderTensor) stays in its blocks under --keep-quantized-weights: the
    weight of a linear layer, of the embeddings or of the experts, in a type the kernels read."""
    return (tensor.tensor_type.name in QUANT_FORMATS and len(tensor.shape) in (2, 3) and bool(targets)
            and all(_is_matrix(t.name) for t in targets))


def _is_matrix(name: str) -> bool:
    return "norm" not in name and (name.endswith(".weight") or name.endswith(("_proj", "exps")))


def check_gguf_tensors(reader, config: ModelConfig, expected: dict[str, tuple[int, ...]], path: Path) -> None:
    """Every tensor of a GGUF has a type the project reads and the shape the config implies, checked from
    the header before any weight is allocated: GGUFLoadError names the tensor (and its type, or the shapes)."""
    found = family(config.family)
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        if qtype not in DENSE_TYPES and qtype not in QUANT_FORMATS:
            raise GGUFLoadError(f"{path}: tensor {tensor.name!r} has type {qtype}, which localserve does not read "
                                f"(it reads {', '.join(DENSE_TYPES + tuple(QUANT_FORMATS))})")
        shape = tuple(int(d) for d in reversed(tensor.shape))
        for target in tensor_targets(tensor, found, config, path):
            want = expected.get(target.name)
            if want is None:
                raise GGUFLoadError(f"{path}: unexpected tensor {tensor.name!r} (for {target.name}) "
                                    f"in a {config.architecture} of this config")
            have = list(shape)
            if target.rows is not None:
                have[target.axis] = len(range(*target.rows, target.step))
            if target.transpose:
                have[-2:] = have[:-3:-1]
            if not same_values(tuple(have), tuple(want)):
                raise GGUFLoadError(f"{path}: tensor {tensor.name!r} has shape {shape}, the metadata implies "
                                    f"{tuple(want)} for {target.name}")


def gguf_weight_bytes(reader, config: ModelConfig, bytes_per_param: float) -> tuple[int, int]:
    """(bytes, bytes) of a GGUF's model weights once loaded: with the tensors `keeps_quantized` names at
    their stored size, and with every tensor dequantized to `bytes_per_param` bytes a value."""
    found = family(config.family)
    stored = dense = 0
    for tensor in reader.tensors:
        targets = found.gguf_targets(tensor.name, config)
        if not targets:
            continue
        as_dense = int(tensor.n_elements * bytes_per_param)
        dense += as_dense
        stored += int(tensor.n_bytes) if keeps_quantized(tensor, targets) else as_dense
    return stored, dense


def iter_gguf_weights(path: Path, config: ModelConfig, reader=None,
                      keep_quantized: bool = False) -> Iterator[tuple[Target, torch.Tensor | QuantizedTensor]]:
    """Yield (target, weight) for every model tensor's part, one tensor at a time: a float32 tensor, or with
    `keep_quantized` a QuantizedTensor for the tensors `keeps_quantized` names."""
    import gguf

    reader = reader or open_gguf(path)
    found = family(config.family)
    for tensor in reader.tensors:
        targets = tensor_targets(tensor, found, config, path)
        if not targets:
            continue  # read into the config
        weight: torch.Tensor | QuantizedTensor
        if keep_quantized and keeps_quantized(tensor, targets):
            blocks = torch.from_numpy(np.array(tensor.data))  # uint8 [..., rows, row_bytes], out of the mmap
            weight = QuantizedTensor(blocks, tensor.tensor_type.name, (*blocks.shape[:-1], int(tensor.shape[0])))
        else:
            try:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:
                raise GGUFLoadError(f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                                    "which cannot be dequantized") from None
            weight = torch.tensor(array, dtype=torch.float32)  # a copy: F32 tensors are views of the mmap
        for target in targets:
            yield target, take(weight, target)
