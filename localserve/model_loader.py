"""Loading and unloading the models of `localserve serve`: what server/registry/registry.py's `ModelRegistry` is handed.

`find_models` turns `-m` (given any number of times) and `--models-dir` into the `ModelCatalog` and each
model's sampling defaults; `EngineLoader` loads one entry of it as an `LLM` with its `EngineThread`
(`LoadedEngine`), and `LoadedEngine.unload` gives everything back: the engine thread stops, the pool is
checked clean, every reference to the weights, the KV pool and the engine is dropped, cycles are
collected (the load froze the garbage collector's view of them: `settle_garbage_collector`), the CUDA
caching allocator hands its blocks back, and on glibc `malloc_trim` returns the freed heap to the system,
so the process's memory goes back to what it was before the load (tests/server/registry/test_model_switch.py
measures it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from localserve.engine.config import EngineConfig
from localserve.engine.engine_thread import EngineThread
from localserve.engine.sampling_params import SamplingParams
from localserve.llm import LLM, read_tokenizer
from localserve.loading.hf import read_model_config, resolve_model_path
from localserve.loading.model_card import ModelCard
from localserve.loading.model_folder import ModelCatalog, ModelEntry, find_model_paths, read_model_files
from localserve.loading.sampling_defaults import SamplingDefaults, sampling_defaults
from localserve.server.registry.description import FileDescription

log = logging.getLogger(__name__)

POOL_CHECK_TIMEOUT_S = 30.0
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 1 << 20  # while a model loads: each weight and pool layer in its own mapping
SERVING_MMAP_THRESHOLD = 32 << 20  # while it serves: glibc's own ceiling (DEFAULT_MMAP_THRESHOLD_MAX)
SERVING_TRIM_THRESHOLD = 256 << 20  # freed heap kept for the next step (malloc_trim at unload returns it)


@dataclass(frozen=True)
class FoundModels:
    """The catalog of the models to serve and each one's sampling defaults, by model id."""

    catalog: ModelCatalog
    sampling_defaults: dict[str, SamplingDefaults]


def find_models(models: Sequence[str], models_dir: Path | None, *, default_name: str | None = None,
                alias: str | None = None, offline: bool = False,
                sampling_overrides: dict[str, float | int] | None = None) -> FoundModels:
    """The models `-m` names (folders, .gguf files, hub repo ids: downloaded now) in order, then those of
    `models_dir`; none of either: the default model. `sampling_overrides`: the sampling flags, applied to
    every model's defaults. Raises ModelCatalogError or ModelLoadError naming the file."""
    found = []
    default_model_path = None
    for model in models:
        path = resolve_model_path(model, offline=offline)
        found.append(read_model_files(path, requested_as=None if Path(model).expanduser().exists() else model))
    if models_dir is not None:
        found += [read_model_files(path) for path in find_model_paths(models_dir)]
    if not found:
        default_model_path = resolve_model_path(None, offline=offline)
        found.append(read_model_files(default_model_path))
    catalog = ModelCatalog(found, default_name=default_name, alias=alias)
    defaults = {}
    for entry in catalog.entries:
        model_defaults = sampling_defaults(entry.files.path, is_default_model=entry.files.path == default_model_path)
        if sampling_overrides:
            model_defaults = replace(model_defaults, **sampling_overrides,
                                     source=f"{model_defaults.source}; {', '.join(sampling_overrides)} "
                                            "from the command line")
        SamplingParams(temperature=model_defaults.temperature, top_k=model_defaults.top_k, top_p=model_defaults.top_p,
                       min_p=model_defaults.min_p)  # raises ValueError, naming the field, on a value it refuses
        defaults[entry.id] = model_defaults
    return FoundModels(catalog, defaults)


class LoadedEngine:
    """One loaded model: its LLM and the engine thread stepping it (server/registry/registry.py's `ModelInMemory`)."""

    def __init__(self, name: str, llm: LLM) -> None:
        self.name = name
        self._llm: LLM | None = llm
        self.engine = EngineThread(llm.engine)
        self.tokenizer = llm.tokenizer
        self.vision = llm.vision  # its image encoder, or None (a text model)
        self.card = ModelCard.read(llm.model_path, llm.model_config)
        self.engine.start()

    def pool_is_clean(self) -> bool:
        """No request holds a block and the block manager's books balance (its integrity check)."""
        return self.engine.call(lambda engine: engine.is_idle_and_clean()).result(POOL_CHECK_TIMEOUT_S)

    def unload(self) -> None:
        """Stop the engine thread and free the model, its engine and its KV pool (see the module's docstring).
        Raises RuntimeError, after freeing, when the pool was not clean (a request left blocks behind)."""
        try:
            clean = self.pool_is_clean()
        except AssertionError as exc:  # the books do not balance: say so, and free the memory anyway
            clean, why = False, str(exc)
        else:
            why = "a request still held blocks"
        self.engine.stop()
        # Drop every reference this object holds; the registry drops this object itself.
        self.engine.engine = None
        self._llm = self.vision = None
        release_freed_memory()
        if not clean:
            raise RuntimeError(f"the KV pool of {self.name} was not clean when it was unloaded: {why}")


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has `malloc_trim`); None elsewhere (musl and macOS return big
    freed blocks on their own)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def map_big_allocations_apart() -> None:
    """While a model loads (EngineLoader sets it before, `keep_step_allocations_in_the_heap` after) glibc
    serves every allocation of MMAP_THRESHOLD or more (a weight, a KV pool's layer) from its own mapping,
    returned to the system when freed. By default the threshold rises to
    the size of the largest block freed so far (up to 32 MiB), after which such blocks come from the
    threads' heaps, where freed pages stay resident: a model unloaded would leave its pool behind."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def keep_step_allocations_in_the_heap() -> None:
    """From now on (a model has loaded) allocations under SERVING_MMAP_THRESHOLD come from the heap, and
    freed heap is kept: a step's activations, logits and gathered KV blocks reuse the memory the last
    step freed. With the load's 1 MiB threshold each of them was a fresh mapping whose pages faulted in
    at every use: a 512-token prefill took 1.08-1.26 s, and 0.98-1.04 s with this (medians of 3 alternated
    runs; the default model, bf16, one thread). What a model holds for good (weights, KV pool) was
    mapped apart during its load, and its unload's `release_freed_memory` trims the heap."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, SERVING_TRIM_THRESHOLD)


def release_freed_memory() -> None:
    """Hand memory freed by Python objects back to the system: collect the cycles (the frozen ones too),
    empty the CUDA caching allocator, and trim glibc's heaps."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        # cuBLAS keeps a workspace per (handle, stream) in the caching allocator (32 MiB each on an H200),
        # and each engine thread can take a new one: an H200 showed 96 MiB still allocated after the first
        # unload and 192 MiB after the fourth. They are made again on the next matrix product.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@dataclass(frozen=True)
class EngineLoader:
    """Loads a catalog entry with the same engine settings, dtype and device for every model."""

    engine_config: EngineConfig
    dtype: torch.dtype | None = None
    device: str | None = None
    keep_quantized_weights: bool | None = None
    chat_template: str | None = None  # --chat-template-file's text, for every model

    def __call__(self, entry: ModelEntry) -> LoadedEngine:
        """Load `entry`'s model and start its engine thread (blocking: minutes for a big model)."""
        map_big_allocations_apart()
        try:
            llm = LLM(str(entry.files.path), dtype=self.dtype, device=self.device, offline=True,
                      engine_config=self.engine_config, keep_quantized_weights=self.keep_quantized_weights)
        finally:
            keep_step_allocations_in_the_heap()
        if self.chat_template is not None:
            llm.tokenizer.chat_template = self.chat_template
        return LoadedEngine(entry.id, llm)

    def describe(self, entry: ModelEntry) -> FileDescription:
        """What `entry`'s files say without loading its weights (blocking: its config and tokenizer are
        read), as this loader would serve it: its context capped alike, --chat-template-file's template."""
        path = entry.files.path
        config, gguf_reader = read_model_config(path)
        tokenizer = read_tokenizer(path, gguf_reader)
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        return FileDescription(self.engine_config.model_len(config.context_length), config.pooling is not None,
                               tokenizer, ModelCard.read(path, config))
