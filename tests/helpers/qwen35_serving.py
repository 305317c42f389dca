"""A tiny random Qwen3.5 served as users run one: the family's real template (Qwen3.5-4B.jinja) and vocabulary
(ggml-vocab-qwen35, 151,936 tokens), `<|im_end|>` its end of generation, in a server on a free port."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.loading.hf import load_model
from tests.helpers.chat_families import family_tokenizer
from tests.helpers.hybrid_models import qwen3_5_config, save_hybrid
from tests.helpers.server import running_server

QWEN35_VOCAB = 151_936


def write_tiny_qwen35(folder: Path) -> Path:
    """The model (hidden 32: the vocabulary is most of it) saved into `folder`."""
    save_hybrid(folder, qwen3_5_config(vocab_size=QWEN35_VOCAB, hidden_size=32, intermediate_size=48))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645]}))  # <|im_end|>
    return folder


@contextmanager
def serve_qwen35(folder: Path, engine_thread_type=None, **config):
    """A server of the model in `folder` (served as "qwen3.5") with the Qwen3.5 family's tokenizer and template,
    on an engine of `config` (its thread an `engine_thread_type` where given); yields the server."""
    loaded = load_model(folder, dtype=torch.float32, device="cpu")
    tokenizer = family_tokenizer("qwen3.5")
    engine = build_engine(loaded.model, tokenizer, EngineConfig(**({"num_kv_blocks": 128, "max_num_seqs": 4,
                                                                    "max_num_batched_tokens": 256} | config)))
    llm = SimpleNamespace(engine=engine, tokenizer=tokenizer, model_config=loaded.config, model_path=folder)
    with running_server(llm, engine_thread_type=engine_thread_type, model_alias="qwen3.5") as server:
        yield server
