"""Ollama's `/api/show` of a model that is not loaded answers from its files, through the official
`ollama` client: it loads nothing and unloads nothing (clients such as editors' plugins show every
model of the list, one after another, to read its capabilities and context), and it says what the
same request says once the model is loaded: a chat folder, a GGUF file with its own tokenizer and
template (the default model's), an embedding model. A model whose files went missing after the
server started is an error naming it, and the server keeps serving the others."""

from __future__ import annotations

import shutil

import ollama
import pytest

from tests.helpers.embedding_models import write_tiny_embedding_model
from tests.helpers.server import running_models_server, write_tiny_chat_model
from tests.helpers.tokenizers import default_model_path

MODELS = ("tiny-a", "tiny-b", "tiny-smol", "tiny-embed")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_chat_model_dir):
    folder = tmp_path_factory.mktemp("show-models")
    (folder / "tiny-a").symlink_to(tiny_chat_model_dir, target_is_directory=True)
    write_tiny_chat_model(folder / "tiny-b", seed=2)
    (folder / "tiny-smol.gguf").symlink_to(default_model_path())
    write_tiny_embedding_model(folder / "tiny-embed")
    write_tiny_chat_model(folder / "tiny-gone", seed=3)
    with running_models_server(folder) as server:  # tiny-a, the folder's first, loaded
        server.folder = folder
        yield server


@pytest.fixture
def client(server):
    return ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=120)


def loaded(client) -> list[str]:
    return [model.model for model in client.ps().models]


def test_a_model_not_loaded_is_shown_from_its_files_as_it_is_shown_loaded(client):
    assert loaded(client) == ["tiny-a"]
    unloaded = {name: client.show(name).model_dump() for name in MODELS[1:]}
    assert loaded(client) == ["tiny-a"]  # nothing loaded, nothing evicted
    assert unloaded["tiny-smol"]["details"]["format"] == "gguf"
    assert unloaded["tiny-smol"]["details"]["quantization_level"] == "Q4_1"
    assert "<|im_start|>" in unloaded["tiny-smol"]["template"]
    assert unloaded["tiny-embed"]["capabilities"] == ["embedding"]
    assert unloaded["tiny-b"]["capabilities"] == ["completion", "tools"]
    assert unloaded["tiny-b"]["parameters"].endswith("num_ctx 512")  # the server's context cap, as loaded
    for name in MODELS[1:]:
        if name == "tiny-embed":
            client.embed(model=name, input="hello")
        else:
            client.generate(model=name, prompt="", keep_alive=-1)  # loads it (one model at a time)
        assert loaded(client) == [name]
        assert client.show(name).model_dump() == unloaded[name], name


def test_a_model_whose_files_went_missing_is_an_error_naming_it(server, client):
    shutil.rmtree(server.folder / "tiny-gone")
    before = loaded(client)
    with pytest.raises(ollama.ResponseError) as failed:
        client.show("tiny-gone")
    assert failed.value.status_code == 503 and "tiny-gone" in failed.value.error
    assert loaded(client) == before  # nothing was unloaded for it
    assert client.show("tiny-a").capabilities == ["completion", "tools"]
