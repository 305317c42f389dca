"""Attention backends by name, imported lazily: `torch` (the reference and the CPU path), `triton` (GPU).

`select_backend("auto", ...)` picks the first backend of `AUTO_ORDER` (fastest first) that supports the
device and both KV formats, and says why.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from localserve.attention.base import AttentionBackend
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


def select_backend(name: str, device: torch.device, key_format: KVFormatSpec, value_format: KVFormatSpec,
                   head_dim: int) -> tuple[AttentionBackend, str]:
    """An instance of the backend `name` (or the best for "auto") and a one-line reason for the choice.

    Raises ValueError when the backend is unknown, or cannot run here with these formats.
    """
    if name != "auto":
        reason = backend_class(name).unsupported_reason(device, key_format, value_format, head_dim)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
        return backend_class(name)(), f"{name} (asked for)"
    passed_over = []
    for candidate in AUTO_ORDER:
        try:
            reason = backend_class(candidate).unsupported_reason(device, key_format, value_format, head_dim)
        except ImportError as exc:  # an optional dependency (triton) is missing
            reason = f"cannot import it ({exc})"
        if reason is None:
            why = f"{candidate} (auto: the fastest that supports {device.type} with K {key_format} / V {value_format}"
            return backend_class(candidate)(), why + "".join(f"; {p}" for p in passed_over) + ")"
        passed_over.append(f"not {candidate}: {reason}")
    raise ValueError("no attention backend supports this device and KV formats: " + "; ".join(passed_over))
