"""Attention backends by name, imported lazily: `torch` (the reference and the CPU path), `triton` (GPU).

`select_backend("auto", ...)` picks the first backend of `AUTO_ORDER` (fastest first) that supports the
device and both KV formats, and says why.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from localserve.attention.base import AttentionBackend, AttentionGeometry
    from localserve.kv.formats import KVFormatSpec

# name -> "module:class"; a backend module is imported only when it is asked for.
BACKENDS = {
    "torch": "localserve.attention.torch_backend:TorchAttentionBackend",
    "triton": "localserve.attention.triton_backend:TritonAttentionBackend",
}
AUTO_ORDER = ("triton", "torch")


class UnknownBackendError(ValueError):
    pass


def check_backend_name(name: str) -> None:
    """Raise UnknownBackendError, naming the known backends, unless `name` is one of them or "auto".
    Imports nothing: a command line is checked before torch is imported."""
    if name != "auto" and name not in BACKENDS:
        raise UnknownBackendError(f"unknown attention backend {name!r}; known: auto, {', '.join(BACKENDS)}")


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name` (a name, not "auto": select_backend resolves that)."""
    check_backend_name(name)
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def unsupported_reason(backend: type[AttentionBackend], device: torch.device, key_format: KVFormatSpec,
                       value_format: KVFormatSpec, head_dim: int,
                       geometries: Sequence[AttentionGeometry] = ()) -> str | None:
    """Why `backend` cannot run here with these formats or cannot compute one of the layers `geometries`
    (naming the first such layer and its value); None when it can."""
    reason = backend.unsupported_reason(device, key_format, value_format, head_dim)
    for layer, geometry in enumerate(geometries):
        if reason is None:
            reason = backend.unsupported_layer(layer, geometry)
    return reason


def select_backend(name: str, device: torch.device, key_format: KVFormatSpec, value_format: KVFormatSpec,
                   head_dim: int, geometries: Sequence[AttentionGeometry] = ()) -> tuple[AttentionBackend, str]:
    """An instance of the backend `name` (or the best for "auto") and a one-line reason for the choice.

    `geometries`: each layer's attention; a layer a backend cannot compute (a head size or window its
    kernels do not take) makes "auto" pass over it, saying which layer and why.
    Raises ValueError when the backend is unknown, or cannot run here with these formats and layers.
    """
    if name != "auto":
        reason = unsupported_reason(backend_class(name), device, key_format, value_format, head_dim, geometries)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
        return backend_class(name)(), f"{name} (asked for)"
    passed_over = []
    for candidate in AUTO_ORDER:
        try:
            reason = unsupported_reason(backend_class(candidate), device, key_format, value_format, head_dim,
                                        geometries)
        except ImportError as exc:  # an optional dependency (triton) is missing
            reason = f"cannot import it ({exc})"
        if reason is None:
            why = f"{candidate} (auto: the fastest that supports {device.type} with K {key_format} / V {value_format}"
            return backend_class(candidate)(), why + "".join(f"; {p}" for p in passed_over) + ")"
        passed_over.append(f"not {candidate}: {reason}")
    raise ValueError("no attention backend supports this device and KV formats: " + "; ".join(passed_over))
