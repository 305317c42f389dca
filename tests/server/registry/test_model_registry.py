"""The models a server serves (server/registry/registry.py's ModelRegistry), on its own: the names a model answers to
and the 404 naming what is served; leases, loads and unloads in arrival order, played with fake loads."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from localserve.loading.model_card import ModelCard
from localserve.loading.model_folder import ModelEntry
from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.model_loader import FoundModels, find_models
from localserve.server.monitor.monitor import serve_monitor
from localserve.server.registry.registry import ModelLease, ModelPolicy, ModelRegistry, ModelStatus, serving_loaded
from localserve.server.request.validation import ProtocolError
from localserve.server.wire.connection_phases import ConnectionBook
from tests.helpers.engine_access import CountingTokenizer, RecordedEngineThread
from tests.helpers.gguf import write_gguf_header, write_hf_folder
from tests.helpers.server import SlowConnection


def one_model(defaults: SamplingDefaults | None = None):
    return serving_loaded(RecordedEngineThread(max_model_len=512), CountingTokenizer(), "own-name", alias="alias",
                          sampling_defaults=defaults or SamplingDefaults(0.5, source="test"))


def test_the_served_model_answers_to_its_names():
    defaults = SamplingDefaults(0.5, top_k=3, source="test")
    models = one_model(defaults)
    entry = models.find("alias")
    for name in (None, "default", "alias", "own-name"):
        assert models.find(name) is entry
    with pytest.raises(ProtocolError) as raised:
        models.find("gpt-4o")
    assert (raised.value.code, raised.value.param, raised.value.status) == ("model_not_found", "model", 404)
    assert "alias" in raised.value.message
    assert models.describe(entry) == {"id": "alias", "object": "model", "created": 0, "owned_by": "localserve",
                                      "status": "loaded", "names": ["alias", "own-name", "default"],
                                      "max_model_len": 512, "sampling_defaults": defaults.to_json(),
                                      "tool_call_format": None, "reasoning": None,  # no chat format given
                                      "architecture": None, "parameters": None,  # nor a card
                                      "takes_images": False}


@pytest.mark.parametrize("name", ["Alias", "alias ", " alias", "alia", "aliases", "own-name-2", "own", "Default",
                                  "", "alias/own-name"])
def test_a_near_miss_of_a_served_name_is_a_404_naming_both(name):
    with pytest.raises(ProtocolError) as raised:
        one_model().find(name)
    assert (raised.value.code, raised.value.param, raised.value.status) == ("model_not_found", "model", 404)
    assert f"model {json.dumps(name)} is not served" in raised.value.message  # what was asked, as JSON shows it
    assert "serves 'alias'" in raised.value.message


def test_the_404_shows_a_long_name_cut():
    with pytest.raises(ProtocolError) as raised:
        one_model().find("m" * 5000)
    assert '"' + "m" * 79 + "..." in raised.value.message and len(raised.value.message) < 300


# ---------------------------------------------------------------------- a folder of models, loads played
class PlayedLoads:
    """The registry's load function, played: each load gives a recorded engine at once (a load of a model
    in `failing` raises); notes loads and unloads, and what went wrong (`faults`: a load or unload that
    overlapped another, an unload of a model with a request on it), since the registry logs a failed
    unload and goes on."""

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.failing = failing
        self.events: list[tuple[str, str]] = []  # ("load" | "unload", model id), in order
        self.held: Counter[str] = Counter()  # leases held now, by model id (kept by the test)
        self.faults: list[str] = []
        self._busy = threading.Lock()

    def __call__(self, entry: ModelEntry) -> PlayedModel:
        with self._exclusive():
            self.events.append(("load", entry.id))
            if entry.id in self.failing:
                raise OSError(f"{entry.files.path}: truncated file")
            return PlayedModel(entry.id, self)

    @contextmanager
    def _exclusive(self):
        if not self._busy.acquire(blocking=False):
            self.faults.append("a load or unload overlapped another")
            yield
            return
        try:
            yield
        finally:
            self._busy.release()

    def unload(self, model_id: str) -> None:
        with self._exclusive():
            if self.held[model_id]:
                self.faults.append(f"{model_id} unloaded with {self.held[model_id]} requests on it")
            self.events.append(("unload", model_id))


class PlayedModel:
    def __init__(self, model_id: str, loads: PlayedLoads) -> None:
        self.model_id, self.loads = model_id, loads
        self.engine, self.tokenizer = RecordedEngineThread(max_model_len=512), CountingTokenizer()
        self.card = ModelCard()

    def unload(self) -> None:
        self.loads.unload(self.model_id)


def write_models_folder(folder: Path) -> Path:
    """Models of each kind and naming case: a GGUF with a quantization suffix and a metadata name, a GGUF
    with neither, an HF folder, two quantizations of one model (sharing their stem), one that fails to load."""
    folder.mkdir(exist_ok=True)
    write_gguf_header(folder / "Alpha-1B.Q4_1.gguf", name="Alpha One")
    write_gguf_header(folder / "beta.gguf")
    write_gguf_header(folder / "broken.gguf")
    write_gguf_header(folder / "Delta.Q4_1.gguf")
    write_gguf_header(folder / "Delta.Q8_0.gguf")
    write_hf_folder(folder / "gamma")
    return folder


# Every name the folder's models answer to, and the model (its id) each names.
SPELLINGS = {
    "Alpha-1B": "Alpha-1B", "Alpha-1B.Q4_1": "Alpha-1B", "Alpha-1B.Q4_1.gguf": "Alpha-1B", "Alpha One": "Alpha-1B",
    "default": "Alpha-1B", "beta": "beta", "beta.gguf": "beta", "broken": "broken", "gamma": "gamma",
    "Delta.Q4_1": "Delta.Q4_1", "Delta.Q4_1.gguf": "Delta.Q4_1", "Delta.Q8_0": "Delta.Q8_0",
    "Delta.Q8_0.gguf": "Delta.Q8_0",
}
AMBIGUOUS = ("Delta",)
UNKNOWN = ("alpha-1b", "Alpha-1B.Q8_0", "Alpha", "gamma.gguf", "Default", "gpt-4o", "", "beta ")


def folder_registry(folder: Path, policy: ModelPolicy | None = None) -> tuple[ModelRegistry, PlayedLoads]:
    found = find_models([], folder)
    policy = policy or ModelPolicy()
    loads = PlayedLoads(("broken",))
    return ModelRegistry(found.catalog, loads, found.sampling_defaults, policy), loads


def settle(registry: ModelRegistry) -> None:
    """Run the event loop until no load or unload is under way and the requests it let through resumed
    (a granted request takes a few turns of the loop to resume: wait_for, shield)."""
    async def wait() -> None:
        quiet_turns = 0
        for _ in range(2000):
            await asyncio.sleep(0.001)
            quiet_turns = 0 if registry.is_switching else quiet_turns + 1
            if quiet_turns == 3:
                return
        raise AssertionError("a load or unload never ended")

    asyncio.get_event_loop().run_until_complete(wait())


def release(lease: ModelLease) -> None:
    """Release on the event loop, as the server does (a release may start an unload there)."""
    async def on_loop() -> None:
        lease.release()

    asyncio.get_event_loop().run_until_complete(on_loop())


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()
    asyncio.set_event_loop(None)


def test_the_folders_models_answer_to_each_spelling_and_refuse_the_rest(tmp_path):
    registry, _ = folder_registry(write_models_folder(tmp_path / "models"))
    assert {name: registry.find(name).id for name in SPELLINGS} == SPELLINGS
    for name in AMBIGUOUS:
        with pytest.raises(ProtocolError) as raised:
            registry.find(name)
        assert (raised.value.code, raised.value.status) == ("model_ambiguous", 400)
        assert "Delta.Q4_1.gguf" in raised.value.message and "Delta.Q8_0.gguf" in raised.value.message
    ids = [entry["id"] for entry in registry.listing()]
    assert ids == ["Alpha-1B", "beta", "broken", "Delta.Q4_1", "Delta.Q8_0", "gamma"]
    for name in UNKNOWN:
        with pytest.raises(ProtocolError) as raised:
            registry.find(name)
        assert (raised.value.code, raised.value.param, raised.value.status) == ("model_not_found", "model", 404)
        assert all(repr(model_id) in raised.value.message for model_id in ids)  # every name it could have sent
    assert {entry["id"]: entry["status"] for entry in registry.listing()} == dict.fromkeys(ids, "unloaded")


def test_a_switch_waits_for_the_old_models_requests_and_serves_the_new_ones_first(tmp_path, loop):
    registry, loads = folder_registry(write_models_folder(tmp_path / "models"))
    alpha, beta = registry.find("Alpha-1B"), registry.find("beta")
    first = loop.run_until_complete(registry.acquire(alpha))
    assert registry.status(alpha) is ModelStatus.LOADED
    for_beta = loop.create_task(registry.acquire(beta))
    alpha_after = loop.create_task(registry.acquire(alpha))  # came after beta's: waits behind it
    settle(registry)
    assert not for_beta.done() and not alpha_after.done()  # alpha's request in flight finishes first
    assert registry.loading_state() | {"elapsed_s": 0} == {"model": "beta", "phase": "waiting", "unloading": "Alpha-1B",
                                                           "elapsed_s": 0}
    assert [entry["status"] for entry in registry.listing()[:2]] == ["loaded", "loading"]
    release(first)
    settle(registry)
    assert for_beta.done() and for_beta.result().model.served_name == "beta" and not alpha_after.done()
    assert loads.events == [("load", "Alpha-1B"), ("unload", "Alpha-1B"), ("load", "beta")]
    release(for_beta.result())
    settle(registry)
    assert alpha_after.result().model.served_name == "Alpha-1B" and registry.loading_state() is None
    assert loads.faults == []
    assert loads.events[3:] == [("unload", "beta"), ("load", "Alpha-1B")]


def test_a_model_that_fails_to_load_fails_its_requests_and_the_others_go_on(tmp_path, loop):
    registry, loads = folder_registry(write_models_folder(tmp_path / "models"))
    broken = [loop.create_task(registry.acquire(registry.find("broken"))) for _ in range(2)]
    settle(registry)
    for task in broken:
        assert (task.exception().code, task.exception().status) == ("model_load_failed", 503)
        assert "truncated file" in task.exception().message
    lease = loop.run_until_complete(registry.acquire(registry.find("gamma")))
    assert lease.model.served_name == "gamma" and loads.events == [("load", "broken"), ("load", "gamma")]


def test_a_model_that_loads_but_cannot_be_served_fails_its_waiters_and_is_unloaded(tmp_path, loop):
    """A fault after the load (here: the loaded model lacks its card) fails the requests waiting for it at
    once with the reason, instead of leaving them to wait out their bound, and the model is freed."""
    registry, loads = folder_registry(write_models_folder(tmp_path / "models"))
    broken = PlayedModel("gamma", loads)
    del broken.card
    registry._load = lambda entry: loads.events.append(("load", entry.id)) or broken
    with pytest.raises(ProtocolError) as raised:
        loop.run_until_complete(asyncio.wait_for(registry.acquire(registry.find("gamma")), 5))
    assert (raised.value.code, raised.value.status) == ("model_load_failed", 503)
    assert "AttributeError" in raised.value.message
    assert loads.events == [("load", "gamma"), ("unload", "gamma")]
    assert registry.serving_now() is None


def test_a_request_waiting_past_the_bound_gets_a_503_and_leaves_the_queue(tmp_path, loop):
    registry, _ = folder_registry(write_models_folder(tmp_path / "models"), ModelPolicy(wait_timeout_s=0.05))
    held = loop.run_until_complete(registry.acquire(registry.find("beta")))
    with pytest.raises(ProtocolError) as raised:
        loop.run_until_complete(registry.acquire(registry.find("gamma")))
    assert (raised.value.code, raised.value.status) == ("model_wait_timeout", 503)
    assert registry.loading_state() is None  # it no longer waits: beta stays, nothing is on its way
    release(held)


def test_an_idle_model_is_unloaded_after_the_sleep_time_and_several_fit_when_allowed(tmp_path, loop):
    registry, loads = folder_registry(write_models_folder(tmp_path / "models"),
                                      ModelPolicy(max_loaded_models=2, sleep_idle_s=0.1))
    for name in ("beta", "gamma"):  # two fit: no unload between them
        release(loop.run_until_complete(registry.acquire(registry.find(name))))
    assert loads.events == [("load", "beta"), ("load", "gamma")]
    loop.run_until_complete(asyncio.sleep(0.3))
    settle(registry)
    assert sorted(loads.events[2:]) == [("unload", "beta"), ("unload", "gamma")]
    assert registry.serving_now() is None


def test_a_requests_keep_alive_sets_how_long_its_model_stays_idle(tmp_path, loop):
    """Ollama's keep_alive: 0 unloads as soon as the model's requests are over; a time replaces the
    server's --sleep-idle-seconds for that model from then on; math.inf keeps it loaded for good."""
    registry, loads = folder_registry(write_models_folder(tmp_path / "models"), ModelPolicy(max_loaded_models=3,
                                                                                           sleep_idle_s=0.5))
    beta, gamma, alpha = (registry.find(name) for name in ("beta", "gamma", "Alpha One"))
    registry.keep_alive(beta, 0.0)
    registry.keep_alive(gamma, math.inf)
    held = loop.run_until_complete(registry.acquire(beta))
    loop.run_until_complete(asyncio.sleep(0.05))
    assert registry.status(beta) is ModelStatus.LOADED  # a request holds it
    release(held)
    for entry in (gamma, alpha):
        release(loop.run_until_complete(registry.acquire(entry)))
    settle(registry)
    assert ("unload", "beta") in loads.events  # at once, not after the 0.5 s
    assert registry.expires_in("gamma") is None and 0 < registry.expires_in("Alpha One") <= 0.5
    loop.run_until_complete(asyncio.sleep(0.8))
    settle(registry)
    assert [name for kind, name in loads.events if kind == "unload"] == ["beta", alpha.id]
    assert registry.status(gamma) is ModelStatus.LOADED  # for good, past the server's 0.5 s
    async def later_request_asks() -> None:  # on the event loop, as the server calls it
        registry.keep_alive(gamma, 0.05)  # a later request's keep_alive applies to an idle model at once

    loop.run_until_complete(later_request_asks())
    loop.run_until_complete(asyncio.sleep(0.2))
    settle(registry)
    assert registry.status(gamma) is ModelStatus.UNLOADED


class RequestsNamingModels(RuleBasedStateMachine):
    """Requests naming random models of the folder (in every spelling, and names no model has) arrive and
    finish in random orders. Always: at most `max_loaded_models` loaded; every lease is on the model its
    request named, and that model stays loaded while it is held; loads and unloads never overlap and never
    unload a model with a request on it (PlayedLoads); a waiting request is never stuck (some lease is
    held whenever one waits); requests for one model are let through in arrival order; unknown names get
    the 404 listing every model; a failed load fails its requests alone."""

    found: FoundModels

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.waiting: list[tuple[int, str, asyncio.Task]] = []  # (arrival, model id, acquire)
        self.held: list[tuple[int, ModelLease]] = []
        self.granted_order: dict[str, list[int]] = {}
        self.granted_before: set[int] = set()  # the arrivals of the leases held at the last settle
        self.arrivals = 0

    @initialize(max_loaded=st.integers(1, 2))
    def start(self, max_loaded: int) -> None:
        self.max_loaded = max_loaded
        self.loads = PlayedLoads(("broken",))
        self.registry = ModelRegistry(self.found.catalog, self.loads, self.found.sampling_defaults,
                                      ModelPolicy(max_loaded_models=max_loaded))

    @rule(name=st.sampled_from(sorted(SPELLINGS)))
    def request(self, name: str) -> None:
        entry = self.registry.find(name)
        self.arrivals += 1
        self.waiting.append((self.arrivals, entry.id, self.loop.create_task(self.registry.acquire(entry))))

    @rule(name=st.sampled_from(UNKNOWN) | st.text(max_size=8).filter(lambda name: name not in SPELLINGS))
    def request_unknown(self, name: str) -> None:
        with pytest.raises(ProtocolError) as raised:
            self.registry.find(name)
        assert raised.value.status == 404 and "'gamma'" in raised.value.message

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish(self, data) -> None:
        arrival, lease = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.loads.held[lease.model.served_name] -= 1
        release(lease)

    @rule()
    def settle(self) -> None:
        settle(self.registry)
        for waiter in [waiter for waiter in self.waiting if waiter[2].done()]:
            self.waiting.remove(waiter)
            arrival, model_id, task = waiter
            if task.exception() is not None:
                assert model_id == "broken" and task.exception().code == "model_load_failed"
                continue
            lease = task.result()
            assert lease.model.served_name == model_id
            self.loads.held[model_id] += 1
            self.held.append((arrival, lease))
            self.granted_order.setdefault(model_id, []).append(arrival)
        if self.max_loaded == 1:  # one at a time: a request waiting for another model is never overtaken
            for arrival, lease in self.held:
                if arrival not in self.granted_before:
                    assert not [waiting for waiting in self.waiting
                                if waiting[0] < arrival and waiting[1] != lease.model.served_name], arrival
        self.granted_before = {arrival for arrival, _ in self.held}
        if self.waiting:  # settled: what still waits, waits for a request being served
            assert self.held, "a request waits and nothing is in the way"
            statuses = {entry["id"]: entry["status"] for entry in self.registry.listing()}
            # its model is on its way, or is the loaded one making room (those after the head wait behind it)
            assert all(statuses[model_id] != "unloaded" for _, model_id, _ in self.waiting), statuses

    @invariant()
    def rules_hold(self) -> None:
        if not hasattr(self, "registry"):
            return
        assert self.loads.faults == []
        statuses = {entry["id"]: entry["status"] for entry in self.registry.listing()}
        assert sum(status == "loaded" for status in statuses.values()) <= self.max_loaded
        assert all(statuses[lease.model.served_name] == "loaded" for _, lease in self.held)
        for model_id, order in self.granted_order.items():
            assert order == sorted(order), (model_id, order)

    def teardown(self) -> None:
        for _, lease in self.held:
            self.loads.held[lease.model.served_name] -= 1
            release(lease)
        settle(self.registry) if hasattr(self, "registry") else None
        for _, _, task in self.waiting:
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()
        asyncio.set_event_loop(None)


def test_requests_naming_random_models_keep_the_rules(tmp_path):
    RequestsNamingModels.found = find_models([], write_models_folder(tmp_path / "models"))
    run_state_machine_as_test(RequestsNamingModels, settings=settings(
        max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)))


def test_the_monitor_follows_the_loaded_model_and_says_what_is_on_its_way(tmp_path, loop):
    registry, _ = folder_registry(write_models_folder(tmp_path / "models"))
    client = SlowConnection([], send_delay_s=0)
    client.wait_closed = client.closed.wait
    counts = ConnectionBook(max_connections=1, max_unfinished_connections=1).counts

    async def main() -> None:
        monitor = asyncio.create_task(serve_monitor(client, registry, 0.02, counts))
        await asyncio.sleep(0.05)  # no model loaded yet
        beta = await registry.acquire(registry.find("beta"))
        await asyncio.sleep(0.05)
        gamma = asyncio.create_task(registry.acquire(registry.find("gamma")))
        await asyncio.sleep(0.05)  # gamma waits for beta's request
        beta.release()
        (await gamma).release()
        await asyncio.sleep(0.05)
        client.closed.set()
        await monitor

    loop.run_until_complete(main())
    kinds = [frame["type"] for frame in client.sent]
    hellos = [frame["model"] for frame in client.sent if frame["type"] == "monitor.hello"]
    assert kinds[0] == "monitor.no_model" and client.sent[0]["loading"] is None
    assert hellos == ["beta", "gamma"]
    waiting = [frame["loading"] for frame in client.sent if frame["type"] == "monitor.snapshot" and frame["loading"]]
    assert waiting and waiting[0] | {"elapsed_s": 0} == {"model": "gamma", "phase": "waiting", "unloading": "beta",
                                                         "elapsed_s": 0}
    after_gamma = client.sent[kinds.index("monitor.hello", kinds.index("monitor.hello") + 1):]
    assert all(frame["type"] == "monitor.hello" or frame["loading"] is None for frame in after_gamma)


def test_every_api_lists_the_same_model_facts(tmp_path):
    registry, _ = folder_registry(write_models_folder(tmp_path / "models"))
    alpha, gamma = registry.models()[0], registry.models()[-1]
    assert (alpha.name, alpha.aliases, alpha.status, alpha.format, alpha.family, alpha.quantization) == (
        "Alpha-1B", ("Alpha-1B.Q4_1.gguf", "Alpha-1B.Q4_1", "Alpha One", "default"), ModelStatus.UNLOADED, "gguf",
        "llama", "Q4_1")
    assert alpha.size_bytes == (tmp_path / "models" / "Alpha-1B.Q4_1.gguf").stat().st_size
    assert (gamma.name, gamma.aliases, gamma.format, gamma.family, gamma.size_bytes) == (
        "gamma", (), "safetensors", "llama", 100)
    assert [info.name for info in registry.models()] == [entry["id"] for entry in registry.listing()]


def test_each_loaded_model_keeps_its_own_prepared_images_and_drops_them_on_unload(tmp_path, loop):
    """`ModelLease.prepared_images` (server/request/image_cache.py): one per load of a model that takes images,
    shared by its leases, another model's apart, a fresh one after an unload; none for a text model."""
    class SeeingLoads(PlayedLoads):
        def __call__(self, entry: ModelEntry) -> PlayedModel:
            model = super().__call__(entry)
            model.vision = object() if entry.id != "gamma" else None  # gamma: a text model
            return model

    found = find_models([], write_models_folder(tmp_path / "models"))
    registry = ModelRegistry(found.catalog, SeeingLoads(("broken",)), found.sampling_defaults, ModelPolicy())
    alpha, beta, gamma = (registry.find(name) for name in ("Alpha-1B", "beta", "gamma"))

    def lease_of(entry: ModelEntry) -> ModelLease:
        return loop.run_until_complete(registry.acquire(entry))

    first, second = lease_of(alpha), lease_of(alpha)
    assert first.prepared_images is second.prepared_images is not None
    first.prepared_images.put(b"pixels", "prepared", 10)
    release(first), release(second)
    on_beta = lease_of(beta)
    assert on_beta.prepared_images is not None and len(on_beta.prepared_images) == 0
    release(on_beta)
    again = lease_of(alpha)  # loaded again: what the first load prepared went with it
    assert again.prepared_images is not first.prepared_images and again.prepared_images.get(b"pixels") is None
    release(again)
    text = lease_of(gamma)
    assert text.vision is None and text.prepared_images is None
    release(text)
