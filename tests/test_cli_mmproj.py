"""`localserve serve --mmproj FILE` refused at once, before any model file is opened (the -m .gguf is a FIFO:
opening it would block past the timeout), when it cannot pair: several -m, a -m that is not a .gguf, no such
mmproj file."""

from __future__ import annotations

import os

import pytest

from tests.helpers.cli_refusal import refusal, run_cli


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
@pytest.mark.parametrize("models, mmproj, message", [
    (["model.gguf", "other.gguf"], "mmproj.gguf", "--mmproj pairs with one -m model (a .gguf file); 2 given"),
    (["folder"], "mmproj.gguf", "--mmproj {tmp}/mmproj.gguf: pairs with a .gguf language model; -m {tmp}/folder is "
                                "not one (a checkpoint folder's vision weights load from the folder)"),
    (["model.gguf"], "missing.gguf", "--mmproj {tmp}/missing.gguf: no such file"),
], ids=["several models", "a folder", "no such file"])
def test_mmproj_that_cannot_pair_is_refused_before_the_model_is_opened(tmp_path, models, mmproj, message):
    os.mkfifo(tmp_path / "model.gguf")
    (tmp_path / "folder").mkdir()
    (tmp_path / "mmproj.gguf").write_bytes(b"GGUF")
    args = ["serve", "--device", "cpu", "--mmproj", str(tmp_path / mmproj)]
    for model in models:
        args += ["-m", str(tmp_path / model)]
    result, _ = run_cli(args)
    assert result.returncode == 2
    assert f"localserve: error: {message.format(tmp=tmp_path)}" in refusal(result)
