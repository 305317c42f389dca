"""Shared by the tokenizer and chat-template tests.

The default model's tokenizer, ours and transformers' (each loaded once per test session), and small
byte-level BPE tokenizers trained in memory for the Llama 3 and Qwen2 templates kept in `templates/`.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from localserve.tokenizer.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "templates"
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["You are a helpful assistant. Hello, world! What is the capital of France? Paris.",
          "system user assistant tool <tool_call> </tool_call> {\"name\": \"get_weather\"}",
          "héllo 😀 世界 café 123 4567 def f(x):\n    return x\n"] * 4


def train_bpe(special_tokens: list[str], vocab_size: int = 600) -> BackendTokenizer:
    """A small byte-level BPE tokenizer whose first ids are `special_tokens`."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


@cache
def default_model_path() -> Path:
    from localserve.loading.default_model import resolve_default_model

    return Path(resolve_default_model())


@cache
def smollm2_tokenizer() -> Tokenizer:
    """Ours, from the default model (its GGUF here; an HF folder where the hub cache has one)."""
    return Tokenizer.from_path(default_model_path())


@cache
def smollm2_reference():
    """transformers' tokenizer for the default model (its own GGUF conversion for a .gguf)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def reference_for(backend: BackendTokenizer, chat_template: str, **special_tokens: str):
    """A transformers tokenizer over the same backend, to render and encode with as the reference."""
    from transformers import PreTrainedTokenizerFast

    clone = BackendTokenizer.from_str(backend.to_str())  # transformers may change the object it is given
    return PreTrainedTokenizerFast(tokenizer_object=clone, chat_template=chat_template, **special_tokens)
