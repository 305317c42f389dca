"""A tiny model whose tokenizer makes grammars meaningful, and the independent checks of constrained output.

The tokenizer is byte-level BPE trained on JSON and tool-call text (so a JSON grammar has whole tokens
like `{"` and `": ` to choose from), with ChatML's special tokens (`<|im_end|>`, id 2, ends a sequence)
and Qwen's added tokens that are not special (`<tool_call>`, `</tool_call>`, `<think>`, `</think>`: one
token each, and also spelled by ordinary tokens). The model is a random tiny Llama whose vocabulary is
a little wider than the tokenizer's, as real models pad theirs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from tests.helpers.models import write_tiny_model
from tests.helpers.tokenizers import CHATML_SPECIALS

ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
EOS = 2  # <|im_end|>
CORPUS = ['{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
          '{"n": 12, "ok": true, "word": "abc"}, {"n": 7, "ok": false, "word": "xyz"}',
          '[1, 2, 3], {"a": [true, false, null]}, "hello world" 0123456789',
          "Let me think about it. The answer is yes. I will call a tool: <tool_call>",
          "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,:;!?-_()[]{}<>/\\'\"\n\t"] * 8
MODEL_VOCAB = 448  # the tokenizer has ~400 ids; the rest are padding no grammar may allow


def write_grammar_model(folder: Path) -> Path:
    """Write the tokenizer and the tiny model into `folder` (an HF model folder); returns it."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=CHATML_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    backend.add_tokens([AddedToken(text, special=False, normalized=False) for text in ADDED])
    assert backend.get_vocab_size() < MODEL_VOCAB
    write_tiny_model(folder, "llama", num_layers=1, vocab_size=MODEL_VOCAB)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS]}))
    return folder


def check_json(text: str, schema: dict) -> None:
    """`text` is one JSON value valid under `schema` (jsonschema, not llguidance)."""
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str, pattern: str) -> None:
    assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"


def after_marker(text: str, marker: str) -> str | None:
    """What follows the first `marker` in `text` (None without one)."""
    index = text.find(marker)
    return None if index < 0 else text[index + len(marker):]
