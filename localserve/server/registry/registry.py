"""The models a server serves, each loaded when a request names it: `ModelRegistry`.

Each loaded model is one engine (its engine thread, KV pool, tokenizer and chat format), given by the
registry's `load` function (localserve/model_loader.py for `localserve serve`) and freed by its
`unload`; the server's parts never see more of it than `EngineAccess` and the tokenizer, lent for one
request at a time by a `ModelLease`.

Loading and unloading follow one queue, in arrival order:
- A request for a loaded model gets its lease at once. A request for another model waits; the first
  waiting request whose model is not loaded (the head) decides what happens next: its model is loaded
  when fewer than `max_loaded_models` are loaded (or loading), else the least recently used loaded
  model is chosen to make room: it takes no new request (those wait behind the head), its requests in
  flight finish first, then it is unloaded and the head's model loaded. Requests for a loaded model
  that is not making room are served even while the head waits, so nothing waits behind a load it
  does not need; a request never waits behind one that came after it for the same model.
- One load or unload at a time, on a worker thread: the event loop goes on serving everyone else.
- A wait is bounded (`wait_timeout_s`): past it the request fails with a reason; a failed load fails
  every request waiting for that model, with the loader's reason, and the server goes on. No waiting
  request is ever dropped without an answer.
- A model with no request for `sleep_idle_s` is unloaded (None: never), or for the time its last
  `keep_alive` asked (Ollama's; `keep_alive`: 0 unloads it once its requests are over, math.inf never).

The monitor follows the model loaded last (`serving_now`); `loading_state` says what is on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from localserve.engine.image_prompt import ImageEncoder
from localserve.loading.model_card import ModelCard
from localserve.loading.model_folder import (
    AmbiguousModelError,
    ModelCatalog,
    ModelEntry,
    ModelFiles,
    UnknownModelError,
)
from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS, SamplingDefaults
from localserve.server.monitor.monitor import MonitorHub, ServingNow, monitor_hello
from localserve.server.registry.description import ModelDescribe, ModelDescriptions, ShownModel
from localserve.server.registry.engine_access import EngineAccess, engine_result
from localserve.server.registry.served_model import ChatTokenizer, ServedModel, model_chat_format
from localserve.server.request.image_cache import PREPARED_IMAGES_BOUND, BytesLRU
from localserve.server.request.validation import ProtocolError, shown

log = logging.getLogger(__name__)


class ModelInMemory(Protocol):
    """One model in memory with its engine thread, as a loader hands it over."""

    engine: EngineAccess
    tokenizer: ChatTokenizer
    card: ModelCard  # its files and shape, for Ollama's and llama.cpp's model endpoints
    # and `vision`, its image encoder (models/vision/adapter.py), where it has one (read with getattr: None)

    def unload(self) -> None:
        """Stop the engine thread and free the engine, its KV pool and the weights (blocking)."""


ModelLoad = Callable[[ModelEntry], ModelInMemory]  # blocking (run on a worker thread); raises with the reason


@dataclass(frozen=True)
class ModelPolicy:
    """How many models stay loaded, for how long, and how long a request waits for its model."""

    max_loaded_models: int = 1  # a 24 GB card holds one model and its KV pool; more where they fit
    sleep_idle_s: float | None = None  # unload a model no request has used for this long (None: never)
    wait_timeout_s: float = 600.0  # a request waiting for its model (the others' requests, the load) fails after

    def __post_init__(self) -> None:
        if self.max_loaded_models < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {self.max_loaded_models}")
        if self.sleep_idle_s is not None and self.sleep_idle_s <= 0:
            raise ValueError(f"--sleep-idle-seconds must be > 0, got {self.sleep_idle_s}")


class ModelStatus(enum.Enum):
    """A model's status as `/v1/models` lists it."""

    LOADED = "loaded"
    LOADING = "loading"  # asked for and on its way: waiting for room, or being read
    UNLOADED = "unloaded"


@dataclass(frozen=True)
class ListedModel:
    """One served model as every API lists it (OpenAI's /v1/models, Ollama's /api/tags, /api/show, /api/ps)."""

    name: str  # its id: the name /v1/models lists
    aliases: tuple[str, ...]  # every other name it answers to, "default" last for the default model
    status: ModelStatus
    format: str | None  # "gguf" or "safetensors" (None: a model handed over loaded)
    family: str | None  # its architecture: "llama", "qwen3" (a GGUF's general.architecture, config.json's model_type)
    parameter_size: str | None  # a GGUF's general.size_label ("135M")
    quantization: str | None  # a GGUF file name's suffix ("Q4_1")
    size_bytes: int  # of its weight files
    modified_s: float | None  # its weights' modification time (seconds since the epoch)
    max_model_len: int | None  # its context, once loaded
    sampling_defaults: SamplingDefaults


class _Phase(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(eq=False)
class _ModelRecord:
    """The registry's record of one model."""

    entry: ModelEntry
    sampling_defaults: SamplingDefaults
    phase: _Phase = _Phase.UNLOADED
    loaded: ModelInMemory | None = None
    serving: ServingNow | None = None
    num_leases: int = 0  # requests being served by it
    last_used: float = 0.0
    loaded_at: float = 0.0  # monotonic time its load ended (the monitor follows the latest)
    load_started: float = 0.0
    unload_started: float = 0.0
    idle_timer: asyncio.TimerHandle | None = None
    keep_alive_s: float | None = None  # the idle time its last request asked for (Ollama's keep_alive)


@dataclass(eq=False)
class _Waiter:
    model: _ModelRecord
    granted: asyncio.Future
    since: float = field(default_factory=time.monotonic)


class ModelLease:
    """One request's use of a loaded model; `release()` when the request is over (more calls: nothing)."""

    def __init__(self, serving: ServingNow, tokenizer: ChatTokenizer, on_release: Callable[[], None]) -> None:
        self.model, self.engine, self.tokenizer = serving.model, serving.engine, tokenizer
        self.vision: ImageEncoder | None = serving.vision  # the model's image encoder (None: text only)
        self.prepared_images = serving.prepared_images  # what `vision` made of pictures seen (image_cache.py)
        self._on_release: Callable[[], None] | None = on_release

    def release(self) -> None:
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()


class ModelRegistry:
    """The catalog's models, loaded and unloaded as requests ask for them (see the module's docstring).
    Its methods, and a lease's `release`, run on the server's event loop."""

    def __init__(self, catalog: ModelCatalog, load: ModelLoad | None,
                 sampling_defaults: Mapping[str, SamplingDefaults], policy: ModelPolicy = ModelPolicy(),
                 loaded: Mapping[str, ModelInMemory] | None = None, describe: ModelDescribe | None = None) -> None:
        """`sampling_defaults` by model id; `loaded`: models loaded already, by id. Without `load` no model is
        ever loaded or unloaded (a server handed one loaded model). `describe` reads a model's description
        from its files (`shown`); without it a model is loaded to be described."""
        self.catalog, self.policy, self._load = catalog, policy, load
        self._descriptions = ModelDescriptions(describe) if describe is not None else None
        self._models = {entry.id: _ModelRecord(entry, sampling_defaults.get(entry.id, LLAMA_CPP_DEFAULTS))
                        for entry in catalog.entries}
        self._queue: deque[_Waiter] = deque()
        self._transition: asyncio.Task | None = None  # the load or unload under way
        for model_id, loaded_model in (loaded or {}).items():
            self._enter_loaded(self._models[model_id], loaded_model)

    def start(self) -> None:
        """On the server's event loop, once: the idle clocks of the models loaded before it start now."""
        for model in self._models.values():
            if model.phase is _Phase.LOADED:
                self._arm_idle_timer(model)

    # ------------------------------------------------------------------ what clients see
    def find(self, name: str | None) -> ModelEntry:
        """The model `name` names; ProtocolError (404 unknown, listing what is served; 400 ambiguous, naming
        the files) otherwise."""
        try:
            return self.catalog.find(name)
        except UnknownModelError as exc:
            served = ", ".join(repr(model_id) for model_id in exc.served)
            raise ProtocolError("model_not_found", f"model {shown(name, 80)} is not served here; this server "
                                f"serves {served} (or send 'default')", "model", status=404) from None
        except AmbiguousModelError as exc:
            raise ProtocolError("model_ambiguous", f"model {shown(name, 80)} names several models here: "
                                f"{', '.join(exc.paths)}; ask for one by its file name", "model") from None

    def status(self, entry: ModelEntry) -> ModelStatus:
        """Loaded, loading (asked for and on its way) or unloaded."""
        model = self._models[entry.id]
        if model.phase is _Phase.LOADED:
            return ModelStatus.LOADED
        if model.phase is _Phase.LOADING or any(waiter.model is model for waiter in self._queue):
            return ModelStatus.LOADING
        return ModelStatus.UNLOADED

    def info(self, entry: ModelEntry) -> ListedModel:
        """What every API lists of `entry`'s model, now."""
        model = self._models[entry.id]
        files = entry.files
        aliases = (*entry.names[1:], "default") if entry is self.catalog.default else entry.names[1:]
        return ListedModel(entry.id, aliases, self.status(entry), files.format, files.architecture,
                         files.parameter_size, files.quantization, files.size_bytes, files.modified_s,
                         model.serving.model.max_model_len if model.serving else None, model.sampling_defaults)

    def models(self) -> list[ListedModel]:
        """Every served model, in the catalog's order (the first model of the folder is the default, unless
        --default-model names another)."""
        return [self.info(entry) for entry in self.catalog.entries]

    def describe(self, entry: ModelEntry) -> dict[str, Any]:
        """The model object of `/v1/models`: id, status, every name it answers to, its context, tool-call
        format, reasoning, architecture and parameters, whether it takes images (null until loaded), the sampling
        it defaults to; a loaded embedding model's `capabilities` say so."""
        info = self.info(entry)
        described = {"id": info.name, "object": "model", "created": 0, "owned_by": "localserve",
                     "status": info.status.value, "names": [info.name, *info.aliases],
                     "max_model_len": info.max_model_len, "sampling_defaults": info.sampling_defaults.to_json()}
        serving = self._models[entry.id].serving  # what only the loaded model tells
        described |= serving.model.chat_fields() if serving is not None else {"tool_call_format": None,
                                                                               "reasoning": None}
        described |= model_shape(serving.model.card if serving is not None else None)
        described["takes_images"] = serving.model.takes_images if serving is not None else None
        if serving is not None and serving.model.is_embedding:
            described["capabilities"] = serving.model.capabilities
        return described

    def listing(self) -> list[dict[str, Any]]:
        """Every model's object of `/v1/models`, in the catalog's order."""
        return [self.describe(entry) for entry in self.catalog.entries]

    def serving_now(self) -> ServingNow | None:
        """The model loaded last (the one the monitor follows), or None when no model is loaded."""
        loaded = [model for model in self._models.values() if model.phase is _Phase.LOADED]
        return max(loaded, key=lambda model: model.loaded_at).serving if loaded else None

    def loading_state(self) -> dict[str, Any] | None:
        """The switch under way, for the monitor and the TUI: `model` (the one on its way), `phase`
        ("waiting": the requests of the model making room finish first; "unloading": that model is being
        freed; "loading": `model` is being read), `unloading` (the model making room, or None) and
        `elapsed_s` (in this phase); None when no model is on its way."""
        now = time.monotonic()
        loading = next((model for model in self._models.values() if model.phase is _Phase.LOADING), None)
        if loading is not None:
            return {"model": loading.entry.id, "phase": "loading", "unloading": None,
                    "elapsed_s": round(now - loading.load_started, 3)}
        head = self._head()
        if head is None:
            return None
        unloading = next((model for model in self._models.values() if model.phase is _Phase.UNLOADING), None)
        if unloading is not None:
            return {"model": head.model.entry.id, "phase": "unloading", "unloading": unloading.entry.id,
                    "elapsed_s": round(now - unloading.unload_started, 3)}
        victim = self._making_room()
        return {"model": head.model.entry.id, "phase": "waiting", "unloading": victim.entry.id if victim else None,
                "elapsed_s": round(now - head.since, 3)}

    @property
    def is_switching(self) -> bool:
        """A load or an unload is running now (on its worker thread)."""
        return self._transition is not None

    # ------------------------------------------------------------------ leases
    @contextlib.asynccontextmanager
    async def leased(self, name: str | None) -> AsyncIterator[ModelLease]:
        """A lease on the model `name` names (loaded first if need be) for the span of an `async with`:
        the model endpoints' way (tokenize, show, props) of reading one model."""
        lease = await self.acquire(self.find(name))
        try:
            yield lease
        finally:
            lease.release()

    async def shown(self, entry: ModelEntry) -> ShownModel:
        """`entry`'s model as the model endpoints describe it (Ollama's /api/show): the loaded model's own,
        else what its files say, read without loading it, so nothing is loaded or evicted for it
        (server/registry/description.py); ProtocolError (503) when its files cannot be read."""
        model = self._models[entry.id]
        if self._descriptions is not None and (model.phase is not _Phase.LOADED or model.serving is None):
            return await self._descriptions.shown(entry, model.sampling_defaults)
        lease = await self.acquire(entry)  # loaded (or, without files to read, loaded for this)
        try:
            return ShownModel(lease.model, getattr(lease.tokenizer, "chat_template", None))
        finally:
            lease.release()

    def loaded(self) -> list[tuple[ListedModel, ServedModel, EngineAccess]]:
        """Each model loaded now, with what its requests see of it and its engine (Ollama's /api/ps)."""
        return [(self.info(model.entry), model.serving.model, model.serving.engine)
                for model in self._models.values() if model.phase is _Phase.LOADED and model.serving is not None]

    async def acquire(self, entry: ModelEntry) -> ModelLease:
        """A lease on `entry`'s model, once it is loaded (this may wait for other requests and a load);
        ProtocolError (503) when the load fails or the wait passes `wait_timeout_s`."""
        model = self._models[entry.id]
        if model.phase is _Phase.LOADED and model is not self._making_room():
            return self._lease(model)
        waiter = _Waiter(model, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._advance()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self.policy.wait_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            self._give_up(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise ProtocolError("model_wait_timeout", f"model {entry.id!r} was not ready within "
                                f"{self.policy.wait_timeout_s:g} s; retry later", "model",
                                error_type="server_error", status=503) from None
        return waiter.granted.result()  # a lease, or the load's failure raised

    def _give_up(self, waiter: _Waiter) -> None:
        """The request stops waiting (timeout, cancelled): out of the queue; a lease granted meanwhile goes back."""
        if waiter in self._queue:
            self._queue.remove(waiter)
        elif waiter.granted.done() and not waiter.granted.exception():
            waiter.granted.result().release()
        self._advance()

    def _lease(self, model: _ModelRecord) -> ModelLease:
        model.num_leases += 1
        model.last_used = time.monotonic()
        if model.idle_timer is not None:
            model.idle_timer.cancel()
            model.idle_timer = None
        return ModelLease(model.serving, model.loaded.tokenizer, lambda: self._release(model))

    def _release(self, model: _ModelRecord) -> None:
        model.num_leases -= 1
        model.last_used = time.monotonic()
        if model.num_leases == 0:
            self._arm_idle_timer(model)
        self._advance()

    # ------------------------------------------------------------------ the queue
    def _head(self) -> _Waiter | None:
        """The first waiting request whose model is not loaded: it decides the next load."""
        return next((waiter for waiter in self._queue if waiter.model.phase is not _Phase.LOADED), None)

    def _making_room(self) -> _ModelRecord | None:
        """The loaded model to unload for the head's model, when the loaded ones leave no room for it."""
        head = self._head()
        if head is None or head.model.phase is not _Phase.UNLOADED:
            return None
        resident = [model for model in self._models.values() if model.phase is not _Phase.UNLOADED]
        if len(resident) < self.policy.max_loaded_models or self._load is None:
            return None
        loaded = [model for model in resident if model.phase is _Phase.LOADED]
        return min(loaded, key=lambda model: model.last_used) if loaded else None

    def _advance(self) -> None:
        """Serve what can be served, then start the next load or unload if none is under way."""
        victim = self._making_room()
        head = self._head()
        behind_head = False  # the model making room still serves the requests that came before the head
        for waiter in list(self._queue):
            behind_head = behind_head or waiter is head
            model = waiter.model
            if model.phase is _Phase.LOADED and not (model is victim and behind_head):
                self._queue.remove(waiter)
                waiter.granted.set_result(self._lease(model))
        if self._transition is not None or head is None or self._load is None:
            return
        if head.model.phase is _Phase.UNLOADED and victim is None:
            self._start(self._load_model(head.model))
        elif victim is not None and victim.num_leases == 0:
            self._start(self._unload_model(victim, "to make room for " + head.model.entry.id))

    def _start(self, transition) -> None:
        self._transition = asyncio.get_running_loop().create_task(transition)

    async def _load_model(self, model: _ModelRecord) -> None:
        entry = model.entry
        model.phase, model.load_started = _Phase.LOADING, time.monotonic()
        log.info("loading model %s (%s)", entry.id, entry.files.path)
        try:
            loaded = await asyncio.to_thread(self._load, entry)
            try:
                self._enter_loaded(model, loaded)
            except Exception:  # loaded but not servable (its facts, its chat template): freed again
                await asyncio.to_thread(loaded.unload)
                raise
        except Exception as exc:  # the requests waiting for it fail; the server goes on
            log.error("loading model %s failed: %s: %s", entry.id, type(exc).__name__, exc)
            model.phase = _Phase.UNLOADED
            error = ProtocolError("model_load_failed", f"model {entry.id!r} could not be loaded: "
                                  f"{type(exc).__name__}: {str(exc)[:500]}", "model", error_type="server_error",
                                  status=503)
            for waiter in [waiter for waiter in self._queue if waiter.model is model]:
                self._queue.remove(waiter)
                waiter.granted.set_exception(error)
        else:
            log.info("model %s loaded in %.1f s (%d tokens of context)", entry.id,
                     time.monotonic() - model.load_started, model.serving.model.max_model_len)
            self._arm_idle_timer(model)
        finally:
            self._transition = None
        self._advance()

    def _enter_loaded(self, model: _ModelRecord, loaded: ModelInMemory) -> None:
        engine, vision = loaded.engine, getattr(loaded, "vision", None)
        served = ServedModel(model.entry.id, engine.facts.max_model_len, model.sampling_defaults,
                             is_embedding=engine.facts.embedding is not None, takes_images=vision is not None,
                             chat_format=model_chat_format(loaded.tokenizer), card=loaded.card)
        hub = MonitorHub(lambda after_seq: engine_result(engine.snapshot_and_events(after_seq)),
                         start_seq=engine.last_event_seq)
        prepared = BytesLRU(PREPARED_IMAGES_BOUND) if vision is not None else None  # dropped on unload
        model.serving = ServingNow(served, engine, hub, monitor_hello(engine.facts, served.served_name), vision,
                                   prepared)
        model.loaded, model.phase = loaded, _Phase.LOADED
        model.loaded_at = model.last_used = time.monotonic()

    async def _unload_model(self, model: _ModelRecord, why: str) -> None:
        started = model.unload_started = time.monotonic()
        log.info("unloading model %s (%s)", model.entry.id, why)
        loaded, model.loaded, model.serving, model.phase = model.loaded, None, None, _Phase.UNLOADING
        try:
            await asyncio.to_thread(loaded.unload)
        except Exception:
            log.exception("unloading model %s failed", model.entry.id)
        finally:
            model.phase = _Phase.UNLOADED
            self._transition = None
        log.info("model %s unloaded in %.1f s", model.entry.id, time.monotonic() - started)
        self._advance()

    # ------------------------------------------------------------------ idle models
    def keep_alive(self, entry: ModelEntry, seconds: float) -> None:
        """How long `entry`'s model stays loaded once idle, from now on (a request's `keep_alive`, which
        Ollama lets each request set; math.inf: for good, 0: unloaded as soon as its requests are over).
        A model handed to the registry is never unloaded."""
        model = self._models[entry.id]
        model.keep_alive_s = seconds
        if model.phase is _Phase.LOADED and not model.num_leases:
            self._arm_idle_timer(model)

    def _idle_s(self, model: _ModelRecord) -> float | None:
        """How long the model may stay idle before it is unloaded (None: for good)."""
        idle_s = model.keep_alive_s if model.keep_alive_s is not None else self.policy.sleep_idle_s
        return None if idle_s is None or idle_s == math.inf or self._load is None else idle_s

    def expires_in(self, name: str) -> float | None:
        """Seconds until the model `name` names is unloaded if no request comes (counted from its last
        request's end, or from now while one runs); None: it stays loaded."""
        model = self._models[self.find(name).id]
        idle_s = self._idle_s(model)
        if idle_s is None:
            return None
        return idle_s if model.num_leases else max(0.0, model.last_used + idle_s - time.monotonic())

    def _arm_idle_timer(self, model: _ModelRecord) -> None:
        if model.idle_timer is not None:
            model.idle_timer.cancel()
            model.idle_timer = None
        idle_s = self._idle_s(model)
        if idle_s is None or model.num_leases:
            return
        model.idle_timer = asyncio.get_running_loop().call_later(idle_s, self._sleep_if_idle, model)

    def _sleep_if_idle(self, model: _ModelRecord) -> None:
        model.idle_timer = None
        if model.phase is not _Phase.LOADED or model.num_leases or any(w.model is model for w in self._queue):
            return
        if self._transition is not None:  # a load or unload is under way: look again in a moment
            model.idle_timer = asyncio.get_running_loop().call_later(0.1, self._sleep_if_idle, model)
            return
        self._start(self._unload_model(model, f"idle for {self._idle_s(model) or 0:g} s"))

    # ------------------------------------------------------------------ the end
    def unload_all(self) -> None:
        """Unload every model (blocking; the server has stopped)."""
        for model in self._models.values():
            if model.loaded is not None:
                loaded, model.loaded, model.serving, model.phase = model.loaded, None, None, _Phase.UNLOADED
                loaded.unload()


@dataclass
class HandedModel:
    """A model loaded by the caller, who also stops its engine thread: unloading it is not the registry's."""

    engine: EngineAccess
    tokenizer: ChatTokenizer
    card: ModelCard = ModelCard()
    vision: ImageEncoder | None = None

    def unload(self) -> None:
        """Nothing: the caller owns the engine thread."""


def serving_loaded(engine: EngineAccess, tokenizer: ChatTokenizer, name: str, *, alias: str | None = None,
                   sampling_defaults: SamplingDefaults = LLAMA_CPP_DEFAULTS,
                   card: ModelCard | None = None, vision: ImageEncoder | None = None) -> ModelRegistry:
    """A registry of one model loaded by the caller (answering to `name`, and `alias` first): never unloaded.
    `vision`: its image encoder (LLM.vision), where it takes images."""
    catalog = ModelCatalog([ModelFiles(None, name, ())], alias=alias)
    model_id = catalog.default.id
    return ModelRegistry(catalog, None, {model_id: sampling_defaults},
                         loaded={model_id: HandedModel(engine, tokenizer, card or ModelCard(), vision)})


def model_shape(card: ModelCard | None) -> dict[str, Any]:
    """`architecture` (the Hugging Face name it is served as) and `parameters` (`total`, and `active`: read
    for each token, fewer than the total for a mixture of experts) of a loaded model's card; null without one."""
    if card is None or not card.architecture:  # not loaded, or a card that knows nothing (a test's)
        return {"architecture": None, "parameters": None}
    return {"architecture": card.architecture,
            "parameters": {"total": card.parameter_count, "active": card.active_parameter_count}}
