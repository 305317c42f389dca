"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import Any

import torch

from localserve.engine.config import EngineConfig
from localserve.engine.engine import LLMEngine, settle_garbage_collector
from localserve.engine.outputs import RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model, resolve_model_path
from localserve.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """A model and its engine in this process.

    `model` is a Hugging Face folder, a hub repo id, a .gguf file, or None for the default model
    (SmolLM2-135M-Instruct). `keep_quantized_weights`: keep a .gguf's quantized weights in their blocks
    (None: on CUDA yes, on a CPU no; see loading/hf.py).
    """

    def __init__(self, model: str | None = None, *, dtype: torch.dtype | None = None, device: str | None = None,
                 offline: bool = False, engine_config: EngineConfig | None = None,
                 keep_quantized_weights: bool | None = None) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        path = resolve_model_path(model, offline=offline)
        loaded = load_model(path, dtype=dtype, device=device, keep_quantized_weights=keep_quantized_weights)
        self.model_path = path  # the local folder or .gguf file the model came from
        self.model_config = loaded.config
        self.tokenizer = Tokenizer.from_gguf(loaded.gguf_reader) if loaded.gguf_reader else Tokenizer.from_path(path)
        self.engine = LLMEngine(loaded.model, self.tokenizer, engine_config)
        settle_garbage_collector()

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); returns one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_lists, params or SamplingParams())

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (a list of role/content messages)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        token_lists = [self.tokenizer.encode_chat(messages) for messages in conversations]
        return self._run(token_lists, params or SamplingParams())

    def _run(self, token_lists: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        ids = [self.engine.add_request(tokens, params) for tokens in token_lists]
        final = self.engine.run_to_completion()
        return [final[i] for i in ids]
