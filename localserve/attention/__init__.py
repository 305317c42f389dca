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

# name -> "module:class"; a backend module is imported only when it is asked for.
BACKENDS = {
    "torch": "localserve.attention.torch_backend:TorchAttentionBackend",
    "triton": "localserve.attention.triton_backend:TritonAttentionBackend",
}
AUTO_ORDER = ("triton", "torch")


class UnknownBackendError(ValueError):
    pass


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`."""
    if name not in BACKENDS:
        raise UnknownBackendError(f"unknown attention backend {name!r}; known: auto, {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def select_backend(name: str, device: torch.device, cache_type_k: str, cache_type_v: str,
                   head_dim: int) -> tuple[AttentionBackend, str]:
    """An instance of the backend `name` (or the best for "auto") and a one-line reason for the choice.

    Raises ValueError when the backend is unknown, or cannot run here with these formats.
    """
    if name != "auto":
        reason = backend_class(name).unsupported_reason(device, cache_type_k, cache_type_v, head_dim)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
        return backend_class(name)(), f"{name} (asked for)"
    passed_over = []
    for candidate in AUTO_ORDER:
        try:
            reason = backend_class(candidate).unsupported_reason(device, cache_type_k, cache_type_v, head_dim)
        except ImportError as exc:  # an optional dependency (triton) is missing
            reason = f"cannot import it ({exc})"
        if reason is None:
            why = f"{candidate} (auto: the fastest that supports {device.type} with K {cache_type_k} / V {cache_type_v}"
            return backend_class(candidate)(), why + "".join(f"; {p}" for p in passed_over) + ")"
        passed_over.append(f"not {candidate}: {reason}")
    raise ValueError("no attention backend supports this device and KV formats: " + "; ".join(passed_over))
