"""`localserve serve`'s models (localserve/model_loader.py): `-m` given several times and `--models-dir`
make one catalog, in order, a model given twice once; `--default-model`, `--alias` and the sampling
flags apply; bad values are refused before any model loads, naming the flag or the folder."""

from __future__ import annotations

import pytest

from localserve.cli import build_parser, main, sampling_overrides
from localserve.model_loader import find_models
from tests.helpers.gguf import write_gguf_header, write_hf_folder


@pytest.fixture
def folder(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    write_gguf_header(models / "beta.Q8_0.gguf", name="Beta")
    write_hf_folder(models / "alpha")
    return models


def test_models_given_by_m_come_first_then_the_folders_and_a_model_given_twice_counts_once(folder, tmp_path):
    extra = write_gguf_header(tmp_path / "gamma.gguf")
    args = build_parser().parse_args(["serve", "-m", str(extra), "-m", str(folder / "beta.Q8_0.gguf"),
                                      "--models-dir", str(folder), "--max-loaded-models", "2",
                                      "--sleep-idle-seconds", "300", "--temp", "0.2"])
    assert (args.max_loaded_models, args.sleep_idle_seconds) == (2, 300.0)
    found = find_models(args.model, args.models_dir, sampling_overrides=sampling_overrides(args))
    assert [entry.id for entry in found.catalog.entries] == ["gamma", "beta", "alpha"]
    assert found.catalog.default.id == "gamma"  # the first -m
    assert {defaults.temperature for defaults in found.sampling_defaults.values()} == {0.2}


def test_the_default_model_and_the_alias_are_chosen_by_name(folder):
    found = find_models([], folder, default_name="Beta", alias="house-model")
    assert found.catalog.default.id == "house-model"
    assert found.catalog.find("beta") is found.catalog.default and found.catalog.find("default").id == "house-model"
    assert found.catalog.find("alpha").id == "alpha"


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-loaded-models", "0"], "--max-loaded-models must be >= 1"),
    (["--sleep-idle-seconds", "0"], "--sleep-idle-seconds must be > 0"),
    (["--default-model", "nope"], "'nope'"),
])
def test_bad_model_flags_are_refused_before_a_model_loads(folder, flags, message, capsys):
    assert main(["serve", "--no-tui", "--models-dir", str(folder), *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_models_folder_is_refused_naming_it(tmp_path, capsys):
    assert main(["serve", "--no-tui", "--models-dir", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such folder (--models-dir)" in capsys.readouterr().err
