"""The server's parts get what they use, not the server: read from the source, no server module imports
the engine, its thread or the KV cache, or reaches into them (`engine_thread.engine`, `.runner`); a
LocalServer runs on any engine thread that offers `EngineAccess` (here one played by the test)."""

from __future__ import annotations

import ast
import asyncio
from concurrent.futures import Future
from pathlib import Path

from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS
from localserve.server.app import LocalServer
from localserve.server.config import ServerConfig
from localserve.server.registry.engine_access import engine_result
from localserve.server.registry.registry import serving_loaded
from localserve.server.registry.served_model import ServedModel
from tests.helpers.server import engine_facts

SERVER = Path(__file__).resolve().parents[2] / "localserve" / "server"
# What a server part may not import: the engine itself, the thread that owns it, the model and the KV cache.
FORBIDDEN_IMPORTS = ("localserve.engine.engine", "localserve.engine.engine_thread", "localserve.engine.model_runner",
                     "localserve.kv", "localserve.models", "localserve.attention")


def server_modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(SERVER)): ast.parse(path.read_text(), str(path))
            for path in sorted(SERVER.rglob("*.py"))}


def test_no_server_module_imports_the_engine_or_reaches_into_it():
    found = []
    for name, tree in server_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import):
                modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                found += [f"{name} imports {module}" for module in modules
                          if any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN_IMPORTS)]
            elif isinstance(node, ast.Attribute) and (
                    node.attr in ("runner", "engine_call")
                    or node.attr == "engine" and isinstance(node.value, ast.Attribute | ast.Name)
                    and getattr(node.value, "attr", getattr(node.value, "id", "")) == "engine_thread"):
                found.append(f"{name}:{node.lineno} reads .{node.attr}")
    assert found == []


def test_the_check_reads_every_room_of_the_server():
    names = server_modules()
    assert {"app.py", "generation/service.py", "registry/registry.py", "wire/transport.py"} <= set(names)


def test_the_check_finds_what_it_looks_for():
    tree = ast.parse("from localserve.kv.cache import PagedKVCache\nx = server.engine_thread.engine.runner\n")
    imports = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    attributes = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)]
    assert imports == ["localserve.kv.cache"] and {"engine", "runner"} <= set(attributes)


class PlayedEngineThread:
    """The EngineAccess of no engine: facts, and reads answered at once from what the test put there."""

    last_event_seq = 41

    def __init__(self) -> None:
        self.facts = engine_facts(max_model_len=300)
        self.stats_reads = 0

    def submit(self, prompt_token_ids, params, on_output, request_id=None):
        raise AssertionError("nothing is submitted here")

    def abort(self, request_id):
        raise AssertionError("nothing is aborted here")

    def stats(self) -> Future:
        self.stats_reads += 1
        future: Future = Future()
        future.set_result("stats")
        return future

    def snapshot_and_events(self, after_seq: int) -> Future:
        future: Future = Future()
        future.set_result(("snapshot", [], after_seq))
        return future


def test_a_server_is_built_from_an_engine_access_and_its_facts():
    engine_thread = PlayedEngineThread()
    server = LocalServer(serving_loaded(engine_thread, None, "played", alias="alias"), ServerConfig())
    serving = server.models.serving_now()
    assert serving.model == ServedModel("alias", 300, LLAMA_CPP_DEFAULTS)
    assert server.models.find("played") is server.models.find("alias")  # its own name, as ever
    assert serving.monitor_hub.last_seq == 41  # events from before the server are not replayed
    hello = serving.monitor_hello
    facts = engine_thread.facts
    assert hello == {"model": "alias", "block_size": facts.block_size, "num_blocks": facts.num_gpu_blocks,
                     "num_cpu_blocks": 0, "max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 300,
                     "cache_type_k": "fp16", "cache_type_v": "fp16", "kv_cache_bytes": 64 * 16 * 512,
                     "capacity": [{"format": "fp16", "bytes_per_token": 512, "num_tokens": 1024}]}
    assert asyncio.run(serving.monitor_hub.latest(0.0)) == "snapshot"
    assert serving.monitor_hub.last_seq == 41  # the read asked for the events after 41 and there were none
    assert asyncio.run(engine_result(engine_thread.stats())) == "stats" and engine_thread.stats_reads == 1
