"""The offline API and the command line on the default model, SmolLM2-135M-Instruct."""

from __future__ import annotations

import json

import pytest

from localserve import LLM, SamplingParams
from localserve.cli import main

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path))


def test_cli_generate_chat_answers_paris_offline(capsys, smollm2_path):
    # The default model (-m omitted) resolves from the local cache: no hub access needed.
    assert main(["generate", "--chat", QUESTION, "--max-tokens", "24", "--offline"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert "INFO" not in out and "loading" not in out  # stdout is the generated text only


def test_generate_returns_text_and_token_ids(llm):
    [output] = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in output.text
    assert llm.tokenizer.decode(output.token_ids) == output.text
    assert output.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not by length


def test_concurrent_greedy_requests_equal_running_alone_in_float32(llm):
    prompts = ["The capital of Italy is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
               "import numpy as np\n", "Water boils at", "My favourite book", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert together == alone
    assert llm.engine.is_idle_and_clean()


def test_stop_string_ends_generation_and_is_cut(llm):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])
    [output] = llm.chat([{"role": "user", "content": QUESTION}], params)
    assert output.outputs[0].finish_reason == "stop"
    assert "Paris" not in output.text and output.text.startswith("The capital of France is")


def test_parallel_samples_with_seed_are_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, n=3, seed=7)
    first = llm.generate("Tell me a story:", params)[0]
    second = llm.generate("Tell me a story:", params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1  # the samples differ from each other


@pytest.mark.parametrize("case", ["missing config", "corrupt safetensors", "unsupported architecture",
                                  "no such path"])
def test_load_errors_are_one_clear_line(tmp_path, capsys, tiny_model_dir, case):
    folder, _ = tiny_model_dir("llama")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (model_dir / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    expected = []
    if case == "missing config":
        expected = [str(model_dir / "config.json"), "missing"]
    elif case == "corrupt safetensors":
        (model_dir / "config.json").write_text(json.dumps(config))
        (model_dir / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")
        expected = [str(model_dir / "model.safetensors"), "corrupt"]
    elif case == "unsupported architecture":
        (model_dir / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
        expected = [str(model_dir / "config.json"), "unsupported architecture", "GPT2LMHeadModel"]
    else:
        model_dir = tmp_path / "nowhere.gguf"
        expected = [str(model_dir), "no such file"]
    assert main(["generate", "-m", str(model_dir), "hello", "--offline"]) == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("localserve: error")]
    assert len(err_lines) == 1
    assert all(text in err_lines[0] for text in expected), err_lines[0]
