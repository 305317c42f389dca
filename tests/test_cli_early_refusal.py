"""A bad KV format on the command line is refused at once, as a bad attention backend is: before torch is
imported and before any model file is opened, naming the valid formats.

The real CLI runs in a subprocess. `-m` names a FIFO called model.gguf: opening it for reading blocks until
a writer comes, which none does, so a CLI that opened the model before refusing would run past the timeout.
`-X importtime` lists every module the process imported, on stderr.
"""

from __future__ import annotations

import os

import pytest

from localserve.kv.formats import FORMAT_NAMES
from tests.helpers.cli_refusal import TIMEOUT_S, imported_modules, refusal, run_cli

UNKNOWN_FORMAT = f"localserve: error: unknown KV cache type 'q5_9'; choose from {', '.join(FORMAT_NAMES)}"
FLAGS = [["-ctk", "q5_9"], ["-ctv", "q5_9"], ["--kv-cache-dtype", "q5_9"]]


@pytest.fixture
def fifo_model(tmp_path):
    path = tmp_path / "model.gguf"
    os.mkfifo(path)
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("flag, message", [(flag, UNKNOWN_FORMAT) for flag in FLAGS] + [
    (["-ctk", "q8_0:-mean"], "localserve: error: unknown KV format option '-mean' for q8_0")],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_a_bad_kv_format_is_refused_before_the_model_is_opened(fifo_model, command, flag, message):
    args = [command, "-m", str(fifo_model), "--device", "cpu", *flag] + (["hello"] if command == "generate" else [])
    result, elapsed = run_cli(args)
    assert result.returncode == 2
    assert elapsed < TIMEOUT_S
    assert refusal(result) == message
    assert "torch" not in {name.split(".")[0] for name in imported_modules(result)}


@pytest.mark.parametrize("flag", FLAGS[:3], ids=lambda flag: " ".join(flag))
def test_with_a_missing_model_the_error_is_about_the_format(tmp_path, flag):
    result, elapsed = run_cli(["serve", "-m", str(tmp_path / "missing.gguf"), *flag])
    assert result.returncode == 2 and elapsed < TIMEOUT_S
    assert refusal(result) == UNKNOWN_FORMAT


def test_a_bad_attention_backend_is_refused_as_early(fifo_model):
    result, elapsed = run_cli(["serve", "-m", str(fifo_model), "--attention-backend", "flash"])
    assert result.returncode == 2 and elapsed < TIMEOUT_S
    assert refusal(result) == "localserve: error: unknown attention backend 'flash'; known: auto, torch, triton"
    assert "torch" not in {name.split(".")[0] for name in imported_modules(result)}
