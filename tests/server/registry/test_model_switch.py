"""A folder of two tiny models served by name (`--models-dir`), one loaded at a time: requests naming
each alternate, concurrently and one after another; every answer is the greedy text of the model it
named (equal to that model loaded alone), no request is lost across a switch, the KV pool is clean at
each unload (the block manager's integrity check, no block held), and the process's memory after each
unload is back to its level before the first load.

The memory is the resident set of this process (CPU): the tiny models' weights are small, so each
engine gets a KV pool of 48 MiB (6144 blocks of 8 KiB) written at load; a model that stayed in memory
would leave at least that much. The tolerance, 32 MiB (two thirds of a pool), holds what the first load
and the first server of a process leave for good besides the model: modules imported on first use and
torch's CPU kernel state and thread pools, measured here at 11.2-11.6 MiB when this test runs first in
its process and 0.1-0.3 MiB when a load came before (another worktree's run saw 20.6 MiB: the RSS of a
process is coarse; the weak references below are the exact check); after the first unload, each further unload comes
back near it (0.3 MiB over seven switches run alone; but in the whole suite, where other tests' threads
share the heap, one CI run saw the last unload 24 MiB above the first), so the growth allowed is 32 MiB,
under the 48 MiB a pool left behind per switch would add. The exact check is by reference: no tensor of
the model's weights or of its KV pool is alive after its unload (weak references taken before it).
On a GPU (`gpu`-marked) the check is exact: `torch.cuda.memory_allocated()` returns to its level."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.llm import LLM
from localserve.loading.model_folder import ModelEntry
from localserve.model_loader import EngineLoader, LoadedEngine
from tests.helpers.load_http import HttpConnection
from tests.helpers.server import running_models_server, write_tiny_chat_model
from tests.helpers.webui_page import get_json

MiB = 1 << 20
POOL_BLOCKS = 6144  # x 8 KiB (2 layers x K and V x 16 tokens x 2 heads x 16 dims x 4 bytes) = 48 MiB
RSS_TOLERANCE = 32 * MiB
RSS_GROWTH_TOLERANCE = 32 * MiB
PROMPTS = ["hello world tell me a story", "what is the capital of france", "the cat and the dog",
           "one two three four", "where is the sun", "tell me about the moon"]
MAX_TOKENS = 6


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Unload:
    """What the test saw at one unload."""

    model: str
    pool_clean: bool
    resident_after: int
    cuda_allocated_after: int
    tensors_held: int  # the model's weights and buffers and its KV pool's tensors before the unload
    tensors_left: int  # those of them still alive after it


class CheckedLoader:
    """The server's loader, noting at each unload whether the pool was clean and the memory after it."""

    def __init__(self, load: EngineLoader) -> None:
        self.load = load
        self.loads: list[str] = []
        self.unloads: list[Unload] = []
        self.listing: list[dict] = []  # /v1/models after the requests
        self.unknown: tuple[int, dict] | None = None  # the answer to a request naming no model of the folder

    def __call__(self, entry: ModelEntry) -> CheckedEngine:
        self.loads.append(entry.id)
        return CheckedEngine(self.load(entry), self)


class CheckedEngine:
    def __init__(self, loaded: LoadedEngine, loader: CheckedLoader) -> None:
        self.loaded, self.loader = loaded, loader
        self.engine, self.tokenizer, self.card = loaded.engine, loaded.tokenizer, loaded.card

    def unload(self) -> None:
        clean = self.loaded.pool_is_clean()
        runner = self.loaded.engine.engine.runner
        held = [weakref.ref(tensor) for tensor in tensors_within(runner.model) + tensors_within(runner.kv_cache)]
        del runner
        name, self.loaded, self.engine = self.loaded.name, self.loaded.unload(), None
        gc.collect()
        self.loader.unloads.append(Unload(name, clean, resident_bytes(),
                                          torch.cuda.memory_allocated() if torch.cuda.is_available() else 0,
                                          len(held), sum(ref() is not None for ref in held)))


def tensors_within(root: object, depth: int = 4) -> list[torch.Tensor]:
    """The tensors `root` holds: a module's parameters and buffers, else those among its attributes,
    lists, tuples and dicts, `depth` levels down."""
    if isinstance(root, torch.nn.Module):
        return [*root.parameters(), *root.buffers()]
    if isinstance(root, torch.Tensor):
        return [root]
    if depth == 0:
        return []
    if isinstance(root, dict):
        children = list(root.values())
    elif isinstance(root, list | tuple):
        children = list(root)
    elif hasattr(root, "__dict__"):
        children = list(vars(root).values())
    else:
        return []
    return [tensor for child in children for tensor in tensors_within(child, depth - 1)]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tiny_chat_model_dir) -> Path:
    """tiny-a: the shared tiny chat model (seed 0); tiny-b: the same shapes drawn from another seed."""
    folder = tmp_path_factory.mktemp("models")
    (folder / "tiny-a").symlink_to(tiny_chat_model_dir, target_is_directory=True)
    write_tiny_chat_model(folder / "tiny-b", seed=2)
    return folder


async def complete(port: int, model: str, prompt: str) -> tuple[int, dict]:
    connection = await HttpConnection.open(port)
    try:
        status, headers = await connection.post("/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        body = b"".join([piece async for piece in connection.body(headers)])
        return status, json.loads(body)
    finally:
        await connection.close()


def load_alone(path: Path, device: str) -> LLM:
    return LLM(str(path), dtype=torch.float32, device=device, engine_config=EngineConfig(num_kv_blocks=64))


def greedy_alone(llm: LLM) -> dict[str, str]:
    """Each prompt's greedy text from a model loaded on its own."""
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {prompt: output.outputs[0].text for prompt, output in zip(PROMPTS, outputs, strict=True)}


def serve_alternating(models_dir: Path, device: str) -> tuple[CheckedLoader, list[tuple[str, str, int, dict]], int]:
    """Serve the folder with one model loaded at a time and send requests naming each in turn; returns
    the loader's notes, (model asked, prompt, status, body) per request, and the memory before the first load."""
    config = EngineConfig(num_kv_blocks=POOL_BLOCKS, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256)
    loader = CheckedLoader(EngineLoader(config, torch.float32, device))
    # Requests naming each model in turn, in its spellings: concurrent ones (a switch with requests of the
    # model unloaded still running and requests of both waiting), then one at a time.
    # tiny-a is loaded for the first; the second waits while the first finishes, tiny-a is unloaded and
    # tiny-b loaded; the third (after it) waits for tiny-b's two, then tiny-a comes back.
    concurrent = list(zip(["tiny-a", "tiny-b", "default", "tiny-b"], PROMPTS, strict=False))
    one_by_one = [("tiny-b", PROMPTS[4]), ("tiny-b", PROMPTS[5])]
    baseline = resident_bytes()
    with running_models_server(models_dir, loader, load_default=False) as server:
        async def main() -> list[tuple[int, dict]]:
            replies = await asyncio.gather(*(complete(server.port, name, prompt) for name, prompt in concurrent))
            for name, prompt in one_by_one:
                replies.append(await complete(server.port, name, prompt))
            return replies

        replies = asyncio.run(asyncio.wait_for(main(), 120))
        loader.listing = get_json(server.port, "/v1/models")["data"]
        loader.unknown = asyncio.run(complete(server.port, "tiny-c", PROMPTS[0]))
    asked = concurrent + one_by_one
    return loader, [(name, prompt, *reply) for (name, prompt), reply in zip(asked, replies, strict=True)], baseline


def check_every_answer_came_from_the_model_it_named(models_dir: Path, results, device: str,
                                                    tiny_a: LLM | None = None) -> None:
    """`tiny_a`: that model loaded alone already (else it is loaded here)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server ran: intra-op threads of a tiny model only spin on 2 shared cores
    try:
        expected = {"tiny-a": greedy_alone(tiny_a or load_alone(models_dir / "tiny-a", device)),
                    "tiny-b": greedy_alone(load_alone(models_dir / "tiny-b", device))}
    finally:
        torch.set_num_threads(num_threads)
    named = {"tiny-a": "tiny-a", "default": "tiny-a", "tiny-b": "tiny-b"}
    for name, prompt, status, body in results:
        assert status == 200, body  # no request lost across a switch
        model = named[name]
        assert body["model"] == model
        assert body["choices"][0]["text"] == expected[model][prompt], (name, prompt)
    assert expected["tiny-a"] != expected["tiny-b"]  # the two models answer differently: the check can fail


def test_requests_alternating_between_two_models_each_get_their_models_answer(models_dir, tiny_chat_llm):
    loader, results, baseline = serve_alternating(models_dir, "cpu")
    check_every_answer_came_from_the_model_it_named(models_dir, results, "cpu", tiny_a=tiny_chat_llm)
    assert loader.loads == ["tiny-a", "tiny-b", "tiny-a", "tiny-b"]  # one switch per change of model
    assert [unload.model for unload in loader.unloads] == loader.loads  # the last one by unload_all
    assert [(model["id"], model["status"]) for model in loader.listing] == [("tiny-a", "unloaded"),
                                                                           ("tiny-b", "loaded")]
    status, body = loader.unknown
    assert (status, body["error"]["code"], body["error"]["param"]) == (404, "model_not_found", "model")
    assert "model \"tiny-c\" is not served here; this server serves 'tiny-a', 'tiny-b'" in body["error"]["message"]
    assert all(unload.pool_clean for unload in loader.unloads), loader.unloads
    # Exact: no weight and no pool tensor survives an unload (each unload tracked the pool's 4 stores at least).
    assert all(unload.tensors_held > 4 and unload.tensors_left == 0 for unload in loader.unloads), loader.unloads
    above = [round((unload.resident_after - baseline) / MiB, 2) for unload in loader.unloads]
    assert all(unload.resident_after - baseline < RSS_TOLERANCE for unload in loader.unloads), above
    # and nothing piles up switch after switch (a pool left behind would add 48 MiB each time)
    assert max(above) - above[0] < RSS_GROWTH_TOLERANCE / MiB, above


@pytest.mark.gpu
def test_on_a_gpu_unloading_gives_back_every_byte_the_load_took(models_dir):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loader, results, _ = serve_alternating(models_dir, "cuda")
    check_every_answer_came_from_the_model_it_named(models_dir, results, "cuda")
    assert all(unload.pool_clean for unload in loader.unloads), loader.unloads
    assert all(unload.tensors_held > 4 and unload.tensors_left == 0 for unload in loader.unloads), loader.unloads
    # At most what was allocated before: unloading also frees cuBLAS workspaces earlier tests left behind.
    after = [unload.cuda_allocated_after for unload in loader.unloads]
    assert all(allocated <= before for allocated in after), (before, after)
