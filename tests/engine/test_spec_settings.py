"""The command line's speculation and step-budget flags (llama.cpp's and vLLM's names), refused at once when
wrong (before torch is imported or the model opened, as test_cli_early_refusal.py checks for KV formats), and a
draft model of another tokenizer refused at start, naming both."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from localserve.cli import build_parser, engine_config
from localserve.engine.config import EngineConfig
from localserve.llm import LLM
from tests.helpers.server import write_tiny_chat_model


def config_of(*flags: str) -> EngineConfig:
    return engine_config(build_parser().parse_args(["generate", "hi", *flags]))


def test_the_flags_set_the_engine_config():
    config = config_of("--spec-type", "ngram", "--spec-tokens", "6", "--max-step-ms", "150")
    assert (config.spec_type, config.spec_tokens, config.max_step_ms) == ("ngram", 6, 150.0)
    assert config_of("--draft-max", "3").spec_tokens == 3  # llama.cpp's name
    assert config_of().max_step_ms == "auto" and config_of().spec_type is None  # the command line's defaults
    assert config_of("--max-step-ms", "off").max_step_ms is None
    assert config_of("-md", "draft.gguf").spec_type == "draft"  # a draft model alone turns drafting on


@pytest.mark.parametrize("flags, message", [
    (["--spec-type", "draft"], "needs a draft model"), (["--max-step-ms", "fast"], "--max-step-ms"),
    (["--max-step-ms", "-5"], "max_step_ms"), (["--spec-tokens", "0"], "spec_tokens")])
def test_bad_flags_are_refused_before_anything_loads(tmp_path, flags, message):
    result = subprocess.run([sys.executable, "-m", "localserve.cli", "generate", "hi", "-m", str(tmp_path / "none"),
                             *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_a_draft_model_of_another_tokenizer_is_refused_naming_both(tiny_chat_model_dir, tmp_path):
    other = write_tiny_chat_model(tmp_path / "other")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = EngineConfig(num_kv_blocks=16, spec_type="draft")
    with pytest.raises(ValueError, match="does not share the tokenizer") as refused:
        LLM(str(tiny_chat_model_dir), device="cpu", engine_config=config, draft_model=str(other))
    assert str(other) in str(refused.value) and str(tiny_chat_model_dir) in str(refused.value)
    llm = LLM(str(tiny_chat_model_dir), device="cpu", engine_config=config, draft_model=str(tiny_chat_model_dir))
    assert llm.engine.scheduler.speculation is not None
