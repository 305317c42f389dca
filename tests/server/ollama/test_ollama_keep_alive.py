"""Ollama's `keep_alive` through the official `ollama` client, on a folder of two tiny models served by
name: 0 unloads the model as soon as its request is over (and a request with nothing to say and
keep_alive 0 is `ollama stop`), a duration sets how long it stays idle (shown as `/api/ps`'s
`expires_at`), a negative one keeps it for good; every spelling Ollama takes, and refusals naming the
field."""

from __future__ import annotations

import json
import math
import time

import ollama
import pytest

from localserve.server.request.keep_alive import MAX_KEEP_ALIVE_S, parse_keep_alive
from localserve.server.request.validation import ProtocolError
from tests.helpers.embedding_models import write_tiny_embedding_model
from tests.helpers.http_api import Api, response, run
from tests.helpers.server import running_models_server, write_tiny_chat_model

GREEDY = {"temperature": 0, "num_predict": 3}


@pytest.mark.parametrize("value, seconds", [
    (0, 0.0), (0.0, 0.0), ("0", 0.0), ("0s", 0.0), (-0.0, 0.0), (300, 300.0), (1.5, 1.5), ("300", 300.0),
    ("5m", 300.0), ("1h30m", 5400.0), ("0.5s", 0.5), (".5s", 0.5), ("250ms", 0.25), ("1h0m30s", 3630.0),
    ("+2m", 120.0), (" 5m ", 300.0), ("1500us", 0.0015), ("2\u00b5s", 2e-6),
    (-1, math.inf), ("-1", math.inf), ("-5m", math.inf),  # negative: for good
    (MAX_KEEP_ALIVE_S, MAX_KEEP_ALIVE_S), (MAX_KEEP_ALIVE_S + 1, math.inf), (10**400, math.inf)])
def test_every_spelling_ollama_takes(value, seconds):
    assert parse_keep_alive(value, "keep_alive") == seconds


@pytest.mark.parametrize("value, code", [
    (True, "invalid_type"), ([5], "invalid_type"), ({"m": 5}, "invalid_type"), ("", "invalid_value"),
    ("5 minutes", "invalid_value"), ("m", "invalid_value"), ("5x", "invalid_value"), ("inf", "invalid_value"),
    ("nan", "invalid_value"), ("1e3", "invalid_value"), ("1.2.3s", "invalid_value"), ("--5m", "invalid_value"),
    (float("nan"), "invalid_value")])
def test_anything_else_is_refused_naming_the_field(value, code):
    with pytest.raises(ProtocolError) as refused:
        parse_keep_alive(value, "keep_alive")
    assert (refused.value.code, refused.value.param) == (code, "keep_alive")


@pytest.mark.parametrize("path, body", [
    ("/api/chat", {"model": "served", "messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"}),
    ("/api/generate", {"model": "served", "prompt": "hi", "keep_alive": True}),
    ("/api/embed", {"model": "served", "input": "hi", "keep_alive": [1]})])
def test_a_bad_keep_alive_is_a_400_in_ollamas_shape(path, body):
    status, _, answer = response(run(Api().call("POST", path, body)))
    assert status == 400 and "'keep_alive'" in json.loads(answer)["error"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_chat_model_dir):
    folder = tmp_path_factory.mktemp("keep-alive-models")
    (folder / "tiny-a").symlink_to(tiny_chat_model_dir, target_is_directory=True)
    write_tiny_chat_model(folder / "tiny-b", seed=2)
    write_tiny_embedding_model(folder / "tiny-embed")
    with running_models_server(folder, load_default=False) as server:
        yield server


@pytest.fixture
def client(server):
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
    for model in ("tiny-a", "tiny-b", "tiny-embed"):  # each test starts with nothing loaded
        client.generate(model=model, prompt="", keep_alive=0)
    wait_for(lambda: not loaded(client))
    return client


def loaded(client) -> dict[str, str]:
    return {model.model: model.expires_at for model in client.ps().models}


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the models never reached the state asked for"
        time.sleep(0.02)


def test_keep_alive_zero_unloads_as_soon_as_the_answer_is_over(client):
    answer = client.generate(model="tiny-a", prompt="hello", options=GREEDY, keep_alive=0)
    assert answer.done and answer.eval_count == 3
    wait_for(lambda: not loaded(client))


def test_a_duration_is_the_idle_time_shown_as_expires_at_then_the_model_goes(client):
    client.chat(model="tiny-a", messages=[{"role": "user", "content": "hi"}], options=GREEDY, keep_alive="3s")
    expires_at = loaded(client)["tiny-a"].timestamp()  # the client parses it
    assert 0 < expires_at - time.time() <= 3.0
    wait_for(lambda: not loaded(client), timeout_s=10.0)


def test_a_negative_keep_alive_keeps_the_model_and_ollama_stop_unloads_it(client):
    client.generate(model="tiny-b", prompt="hello", options=GREEDY, keep_alive=-1)
    time.sleep(0.3)
    assert list(loaded(client)) == ["tiny-b"] and loaded(client)["tiny-b"].year == 9999  # never
    stopped = client.generate(model="tiny-b", prompt="", keep_alive=0)  # what `ollama stop` sends
    assert stopped.done and stopped.done_reason == "unload"
    wait_for(lambda: not loaded(client))
    again = client.generate(model="tiny-b", prompt="", keep_alive=0)  # not loaded: nothing to load for it
    assert again.done_reason == "unload" and not loaded(client)


def test_an_embed_request_sets_the_keep_alive_too(client):
    assert len(client.embed(model="tiny-embed", input="hello", keep_alive=0).embeddings) == 1
    wait_for(lambda: not loaded(client))
