"""Shared by the server tests: a tiny model with a word-level chat tokenizer, servers on free ports."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from tests.helpers.models import write_tiny_model

SPECIAL_TOKENS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]  # ids 0-3; <|im_end|> is the model's eos (2)
WORDS = ("hello world the a an is are you me we they what where when how why who which this that with for "
         "of to in on at by from and or not yes no please thanks good bad new old big small cat dog sun moon "
         "sky tell story about say hi there one two three four five six seven eight nine ten system user "
         "assistant helpful answer question capital france paris city river").split()
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB_SIZE = 256  # the tiny models' vocabulary


def write_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    """A random tiny Llama (its weights drawn from `seed`) plus a word-level tokenizer covering all 256 ids,
    with a ChatML template."""
    write_tiny_model(folder, "llama", seed=seed)
    words = WORDS + [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(WORDS))]
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + words)}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def openai_client(port: int, timeout: float = 60):
    """An `openai` client of the server on `port` (no retries: a test sees the first answer); a context manager."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=timeout)


def make_llm(path, num_kv_blocks: int = 256, max_num_seqs: int = 16, max_model_len: int | None = None):
    from localserve.engine.config import EngineConfig
    from localserve.llm import LLM

    config = EngineConfig(num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=256)
    return LLM(str(path), device="cpu", engine_config=config)


@contextmanager
def running_server(llm, engine_thread_type=None, model_alias=None, sampling_defaults=None, **config):
    """A LocalServer for `llm` on a free port, in a background thread; yields the BackgroundServer.
    `engine_thread_type`: an EngineThread subclass to run the engine on (a recording one, say);
    `max_message_bytes` given: the body's whole bound, with no room added for images unless
    `max_image_body_bytes` says so;
    `model_alias`: the name it is served under (besides its own); `sampling_defaults`: for requests that set none.

    torch runs on one thread meanwhile: on a shared 2-core machine, intra-op threads of a tiny model
    spin against the clients and the other processes (a step is ~10x slower with two).
    """
    import torch

    from localserve.engine.engine_thread import EngineThread
    from localserve.loading.model_card import ModelCard
    from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS
    from localserve.server.app import BackgroundServer, LocalServer
    from localserve.server.config import ServerConfig
    from localserve.server.registry.registry import serving_loaded

    if "max_message_bytes" in config:  # the tests that bound the body bound it whole, images included
        config.setdefault("max_image_body_bytes", 0)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine_thread = (engine_thread_type or EngineThread)(llm.engine)
    engine_thread.start()
    try:
        models = serving_loaded(engine_thread, llm.tokenizer, llm.model_config.name, alias=model_alias,
                                sampling_defaults=sampling_defaults or LLAMA_CPP_DEFAULTS,
                                card=ModelCard.read(llm.model_path, llm.model_config),
                                vision=getattr(llm, "vision", None))
        server = BackgroundServer(LocalServer(models, ServerConfig(port=0, **config))).start()
        try:
            yield server
        finally:
            server.stop()
    finally:
        engine_thread.stop()
        torch.set_num_threads(num_threads)


async def collect_response(connection) -> list[dict]:
    """Raw events (dicts) of one response from a websockets connection, up to its closing event."""
    events = []
    while True:
        event = json.loads(await connection.recv())
        events.append(event)
        if event["type"] in CLOSING_EVENTS or event["type"] == "error":
            return events


CLOSING_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def wait_until_idle(engine_thread, timeout: float = 30.0) -> None:
    """Block until the engine holds no request, then check that every block is free or cached."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine_thread.call(lambda engine: not engine.has_unfinished_requests()).result(timeout):
            assert engine_thread.call(lambda engine: engine.is_idle_and_clean()).result(timeout)
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not become idle")


class SlowConnection:
    """Delivers the client's frames, then waits until told to close; each send takes `send_delay_s`."""

    def __init__(self, frames: list[str], send_delay_s: float) -> None:
        self.frames = frames
        self.sent: list[dict] = []
        self.send_delay_s = send_delay_s
        self.closed = asyncio.Event()

    def __aiter__(self):
        return self._frames()

    async def _frames(self):
        for frame in self.frames:
            yield frame
        await self.closed.wait()

    async def send(self, message: str) -> None:
        await asyncio.sleep(self.send_delay_s)
        self.sent.append(json.loads(message))

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed.set()

    async def ping(self) -> asyncio.Future:
        pong = asyncio.get_running_loop().create_future()
        pong.set_result(0.0)  # answered at once: this client always reads
        return pong


def engine_facts(max_model_len: int = 512):
    """The facts of a small engine, for engine threads played by a test (no engine behind them)."""
    from localserve.engine.facts import EngineFacts, KvCapacity

    return EngineFacts(max_model_len=max_model_len, vocab_size=256, block_size=16, num_gpu_blocks=64,
                       num_cpu_blocks=0, max_num_seqs=16, max_num_batched_tokens=256, cache_type_k="fp16",
                       cache_type_v="fp16", kv_bytes_per_token=512, capacity=(KvCapacity("fp16", 512, 1024),))


@contextmanager
def running_models_server(models_dir: Path, load=None, policy=None, load_default: bool = True, **config):
    """A LocalServer for every model of `models_dir` (tiny models: CPU, float32, small pools), one loaded at
    a time unless `policy` says more, on a free port in a background thread; yields the BackgroundServer.
    `load`: the loader (default: the server's own, EngineLoader); `load_default`: load the default model
    before serving, as `localserve serve` does. Every model is unloaded when it ends."""
    import torch

    from localserve.engine.config import EngineConfig
    from localserve.model_loader import EngineLoader, find_models
    from localserve.server.app import BackgroundServer, LocalServer
    from localserve.server.config import ServerConfig
    from localserve.server.registry.registry import ModelPolicy, ModelRegistry

    found = find_models([], models_dir)
    load = load or EngineLoader(EngineConfig(num_kv_blocks=256, max_model_len=512, max_num_seqs=16,
                                             max_num_batched_tokens=256), torch.float32, "cpu")
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    default = found.catalog.default
    loaded = {default.id: load(default)} if load_default else {}
    registry = ModelRegistry(found.catalog, load, found.sampling_defaults, policy or ModelPolicy(), loaded=loaded,
                             describe=getattr(load, "describe", None))  # a played loader may have none
    try:
        server = BackgroundServer(LocalServer(registry, ServerConfig(port=0, **config))).start()
        try:
            yield server
        finally:
            server.stop()
    finally:
        registry.unload_all()
        torch.set_num_threads(num_threads)


def post_raw(port: int, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST `body` as JSON (with `headers`) on a connection of its own; the status and the answer's bytes."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    status, data = response.status, response.read()
    connection.close()
    return status, data


def post_json(port: int, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST `body` as JSON on a connection of its own; the status and the JSON answer."""
    status, data = post_raw(port, path, body, headers)
    return status, json.loads(data)


def post_ok(port: int, path: str, body: dict) -> dict:
    """POST `body` as JSON; the JSON answer, which must come with 200."""
    status, answer = post_json(port, path, body)
    assert status == 200, answer
    return answer
