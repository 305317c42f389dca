"""A folder of models: what is found, the names each model answers to, and the names refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from localserve.loading.default_model import default_gguf_path
from localserve.loading.gguf_header import GGUFHeaderError, read_gguf_metadata
from localserve.loading.model_folder import (
    AmbiguousModelError,
    ModelCatalog,
    ModelCatalogError,
    ModelFiles,
    UnknownModelError,
    find_model_paths,
    quantization_suffix,
    read_model_files,
)
from tests.helpers.gguf import write_gguf_header, write_hf_folder


def catalog_of(folder: Path, **options) -> ModelCatalog:
    return ModelCatalog([read_model_files(path) for path in find_model_paths(folder)], **options)


@pytest.mark.parametrize(("stem", "suffix"), [
    ("SmolLM2-135M-Instruct.Q4_1", "Q4_1"), ("Llama-3.2-1B-Instruct-Q4_K_M", "Q4_K_M"),
    ("qwen2.5-0.5b-instruct-q8_0", "q8_0"), ("Mistral-7B-v0.3.IQ4_XS", "IQ4_XS"), ("model_f16", "f16"),
    ("Qwen3-4B-UD-Q4_K_XL", "UD-Q4_K_XL"), ("x.BF16", "BF16"), ("SmolLM2-135M-Instruct", None), ("Q4_0", None),
    ("Qwen2-7B", None), ("llama-3-8b", None)])
def test_the_quantization_suffix_of_a_file_stem(stem, suffix):
    assert quantization_suffix(stem) == suffix


def test_a_gguf_answers_to_its_file_name_its_stems_and_its_metadata_names(tmp_path):
    path = write_gguf_header(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", name="SmolLM2 135M Instruct",
                             basename="smollm2")
    files = read_model_files(path)
    assert files.file_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert files.derived_names == ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1", "SmolLM2 135M Instruct",
                                   "smollm2")
    assert (files.format, files.quantization, files.architecture) == ("gguf", "Q4_1", "llama")
    assert files.size_bytes == path.stat().st_size
    catalog = ModelCatalog([files])
    entry = catalog.default
    assert entry.id == "SmolLM2-135M-Instruct"
    assert entry.names == ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1",
                           "SmolLM2 135M Instruct", "smollm2")
    for name in (*entry.names, "default", None):
        assert catalog.find(name) is entry


def test_a_model_folder_answers_to_its_folder_name(tmp_path):
    catalog = catalog_of(write_hf_folder(tmp_path / "tiny-llama").parent)
    entry = catalog.default
    assert (entry.id, entry.names, entry.files.format, entry.files.size_bytes) == (
        "tiny-llama", ("tiny-llama",), "safetensors", 100)
    assert entry.files.architecture == "llama"  # config.json's model_type


def test_a_hub_repo_answers_to_its_id_and_its_last_part_not_to_its_snapshot_hash(tmp_path):
    snapshot = write_hf_folder(tmp_path / "8f7e6d5c")
    entry = ModelCatalog([read_model_files(snapshot, requested_as="HuggingFaceTB/SmolLM2-135M-Instruct")]).default
    assert entry.names == ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_the_folder_holds_gguf_files_and_model_folders_only(tmp_path):
    write_gguf_header(tmp_path / "b.Q8_0.gguf")
    write_hf_folder(tmp_path / "A-folder")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty-folder").mkdir()
    write_gguf_header(tmp_path / ".hidden.gguf")
    assert [path.name for path in find_model_paths(tmp_path)] == ["A-folder", "b.Q8_0.gguf"]
    with pytest.raises(ModelCatalogError, match="no such folder"):
        find_model_paths(tmp_path / "missing")
    with pytest.raises(ModelCatalogError, match="no models to serve"):
        ModelCatalog([])


def test_the_first_model_is_the_default_unless_one_is_named(tmp_path):
    write_gguf_header(tmp_path / "alpha.Q4_0.gguf")
    write_gguf_header(tmp_path / "beta.Q4_0.gguf")
    assert catalog_of(tmp_path).default.id == "alpha"
    assert catalog_of(tmp_path, default_name="beta.Q4_0.gguf").default.id == "beta"
    with pytest.raises(ModelCatalogError, match="--default-model 'gamma' names no model; the models are 'alpha', "
                                                "'beta'"):
        catalog_of(tmp_path, default_name="gamma")


def test_an_alias_becomes_the_default_models_id(tmp_path):
    write_gguf_header(tmp_path / "alpha.Q4_0.gguf")
    write_gguf_header(tmp_path / "beta.Q4_0.gguf")
    catalog = catalog_of(tmp_path, alias="chat")
    assert catalog.default.id == "chat" and catalog.default.names[:2] == ("chat", "alpha")
    assert catalog.find("chat") is catalog.find("alpha") is catalog.default
    with pytest.raises(ModelCatalogError, match="--alias 'beta' is already a name of .*beta.Q4_0.gguf"):
        catalog_of(tmp_path, alias="beta")


def test_two_quantizations_of_one_model_share_their_stem_which_then_names_neither(tmp_path):
    write_gguf_header(tmp_path / "SmolLM2.Q4_1.gguf", name="SmolLM2 135M")
    write_gguf_header(tmp_path / "SmolLM2.Q8_0.gguf", name="SmolLM2 135M")
    catalog = catalog_of(tmp_path)
    q4, q8 = catalog.entries
    assert (q4.id, q8.id) == ("SmolLM2.Q4_1", "SmolLM2.Q8_0")  # the stem, the quantization kept
    assert catalog.find("SmolLM2.Q8_0.gguf") is q8
    for name in ("SmolLM2", "SmolLM2 135M"):
        with pytest.raises(AmbiguousModelError) as raised:
            catalog.find(name)
        assert [Path(path).name for path in raised.value.paths] == ["SmolLM2.Q4_1.gguf", "SmolLM2.Q8_0.gguf"]


def test_a_file_name_is_its_models_alone_even_when_another_derives_it(tmp_path):
    write_hf_folder(tmp_path / "tiny")
    write_gguf_header(tmp_path / "tiny.Q4_0.gguf")  # its stem without the suffix is the folder's name
    catalog = catalog_of(tmp_path)
    folder, gguf_file = catalog.entries
    assert catalog.find("tiny") is folder and gguf_file.id == "tiny.Q4_0"


def test_two_models_with_one_file_name_are_refused_at_start_naming_both_files(tmp_path):
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    found = [read_model_files(write_gguf_header(folder / "model.gguf")) for folder in (first, second)]
    with pytest.raises(ModelCatalogError) as raised:
        ModelCatalog(found)
    assert str(first / "model.gguf") in str(raised.value) and str(second / "model.gguf") in str(raised.value)


def test_a_model_given_twice_is_served_once(tmp_path):
    path = write_gguf_header(tmp_path / "alpha.gguf")
    assert len(ModelCatalog([read_model_files(path), read_model_files(tmp_path / "." / "alpha.gguf")]).entries) == 1


def test_an_unknown_name_lists_what_is_served(tmp_path):
    write_gguf_header(tmp_path / "alpha.Q4_0.gguf")
    write_hf_folder(tmp_path / "beta")
    with pytest.raises(UnknownModelError) as raised:
        catalog_of(tmp_path).find("gamma")
    assert raised.value.served == ("alpha", "beta")


def test_a_gguf_with_an_unreadable_header_answers_to_its_file_names(tmp_path):
    broken = tmp_path / "broken.Q4_0.gguf"
    broken.write_bytes(b"GGUF\x03\0\0\0" + b"\xff" * 40)
    entry = ModelCatalog([read_model_files(broken)]).default
    assert entry.names == ("broken", "broken.Q4_0.gguf", "broken.Q4_0")


def test_a_model_handed_over_loaded_has_no_files():
    catalog = ModelCatalog([ModelFiles(None, "played", ())], alias="alias")
    assert catalog.default.names == ("alias", "played")


# ------------------------------------------------------------------ the header reader
def test_the_header_reader_agrees_with_the_gguf_package(tmp_path):
    path = write_gguf_header(tmp_path / "m.gguf", name="M", basename="m", **{"x.text": "é ü"})
    reader = gguf.GGUFReader(path)
    keys = ["general.architecture", "general.name", "general.basename", "x.text", "llama.context_length"]
    assert read_gguf_metadata(path, keys + ["absent"]) == {key: reader.fields[key].contents() for key in keys}


@pytest.mark.skipif(not default_gguf_path().is_file(), reason="the default model's GGUF is not cached here")
def test_the_header_reader_reads_the_default_models_gguf_as_the_gguf_package_does():
    path = default_gguf_path()
    reader = gguf.GGUFReader(path)
    keys = [key for key, field in reader.fields.items() if field.types[0] != gguf.GGUFValueType.ARRAY
            and not key.startswith("GGUF.")]
    assert read_gguf_metadata(path, keys) == {key: reader.fields[key].contents() for key in keys}


@given(st.binary(max_size=64))
def test_the_header_reader_refuses_any_bytes_with_its_own_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("h") / "x.gguf"
    path.write_bytes(b"GGUF\x03\0\0\0" + data)
    try:
        read_gguf_metadata(path, ["general.name"])
    except GGUFHeaderError as exc:
        assert str(path) in str(exc)


def test_the_header_reader_refuses_what_is_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(np.arange(10, dtype=np.uint8).tobytes())
    with pytest.raises(GGUFHeaderError, match="no GGUF magic"):
        read_gguf_metadata(path, ["general.name"])
