"""Where a server's sampling defaults come from: the model's generation_config.json, the default model's
entry, or llama.cpp's defaults; and the command line's flags over them."""

from __future__ import annotations

import json

import pytest

from localserve.cli import build_parser, sampling_overrides
from localserve.loading.sampling_defaults import (
    DEFAULT_MODEL_DEFAULTS,
    LLAMA_CPP_DEFAULTS,
    SamplingDefaults,
    sampling_defaults,
)
from localserve.model_loader import find_models


def model_folder(tmp_path, generation_config=None):
    (tmp_path / "config.json").write_text("{}")
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def test_generation_config_fields_win_and_missing_ones_are_off(tmp_path):
    folder = model_folder(tmp_path, {"bos_token_id": 1, "temperature": 0.6, "top_p": 0.9, "do_sample": True})
    defaults = sampling_defaults(folder, is_default_model=True)
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.min_p) == (0.6, None, 0.9, 0.0)
    assert defaults.source == "generation_config.json"


def test_do_sample_false_is_greedy(tmp_path):
    folder = model_folder(tmp_path, {"do_sample": False, "temperature": 0.7, "top_k": 20})
    assert sampling_defaults(folder, is_default_model=False).temperature == 0.0


def test_a_generation_config_without_sampling_fields_falls_through(tmp_path):
    folder = model_folder(tmp_path, {"bos_token_id": 1, "eos_token_id": 2})
    assert sampling_defaults(folder, is_default_model=False) == LLAMA_CPP_DEFAULTS
    assert sampling_defaults(folder, is_default_model=True) == DEFAULT_MODEL_DEFAULTS


def test_no_generation_config_gets_llama_cpp_defaults(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    defaults = sampling_defaults(gguf, is_default_model=False)
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.min_p) == (0.8, 40, 0.95, 0.05)
    assert "temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (llama.cpp's defaults)" == defaults.describe()


def test_an_unreadable_generation_config_is_ignored(tmp_path, caplog):
    folder = model_folder(tmp_path)
    (folder / "generation_config.json").write_text("{not json")
    assert sampling_defaults(folder, is_default_model=False) == LLAMA_CPP_DEFAULTS
    assert "ignoring" in caplog.text


def test_command_line_flags_override_the_models_defaults(tmp_path):
    folder = model_folder(tmp_path, {"temperature": 0.6, "top_p": 0.9})
    args = build_parser().parse_args(["serve", "-m", str(folder), "--temp", "0.3", "--min-p", "0.1"])
    defaults = served_defaults(args)
    assert (defaults.temperature, defaults.top_p, defaults.min_p) == (0.3, 0.9, 0.1)
    assert "temperature, min_p from the command line" in defaults.source
    bad = build_parser().parse_args(["serve", "-m", str(folder), "--top-p", "0"])
    with pytest.raises(ValueError, match="top_p"):
        served_defaults(bad)


def served_defaults(args) -> SamplingDefaults:
    """The sampling defaults `localserve serve` gives the one model its -m names."""
    found = find_models(args.model, None, sampling_overrides=sampling_overrides(args))
    return found.sampling_defaults[found.catalog.default.id]


def test_greedy_defaults_describe_only_the_temperature():
    assert SamplingDefaults(0.0, top_k=40, source="x").describe() == "temperature 0 (x)"
