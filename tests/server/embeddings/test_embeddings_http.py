"""POST /v1/embeddings against the official `openai` SDK and POST /api/embed against the `ollama` package,
on a tiny random Qwen3 embedding model (tests/helpers/embedding_models.py): vectors equal transformers'
hidden states pooled the same way, in floats and base64, cut to `dimensions`; every bound answered with a
400 naming the field (at the limit accepted, one past it refused), never a 5xx, every KV block back."""

from __future__ import annotations

import base64
import json
from typing import NamedTuple

import httpx
import numpy as np
import ollama
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from localserve.engine.config import EngineConfig
from localserve.llm import LLM
from localserve.server.request.generation_request import RequestLimits
from tests.helpers.embedding_models import cosine, reference_embedding, write_tiny_embedding_model
from tests.helpers.json_strategies import extreme_numbers, json_values, maybe, nasty_text
from tests.helpers.server import openai_client, running_server

MAX_MODEL_LEN = 48
MAX_INPUTS = 6
HIDDEN_SIZE = 64
VOCAB_SIZE = 256
TEXTS = ["hello world", "the cat and the dog", "what is the capital of france"]


class Setup(NamedTuple):
    server: object
    llm: LLM
    reference: object  # transformers' Qwen3Model of the same weights

    def __repr__(self) -> str:  # hypothesis prints its arguments: not the model's module tree
        return "Setup(tiny-embed)"


@pytest.fixture(scope="module")
def embedding_setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embedding-server")
    reference = write_tiny_embedding_model(folder, "last")
    llm = LLM(str(folder), device="cpu", engine_config=EngineConfig(
        num_kv_blocks=32, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32, check_integrity=True))
    with running_server(llm, model_alias="tiny-embed", limits=RequestLimits(max_embedding_inputs=MAX_INPUTS)) as server:
        yield Setup(server, llm, reference)


@pytest.fixture(scope="module")
def client(embedding_setup):
    server, _, _ = embedding_setup
    with openai_client(server.port) as client:
        yield client


@pytest.fixture(scope="module")
def http(embedding_setup):
    server, _, _ = embedding_setup
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as http:
        yield http


def expected(llm, reference, text: str, dimensions: int | None = None):
    return reference_embedding(reference, llm.tokenizer.encode(text), "last", dimensions=dimensions)


def assert_clean(llm) -> None:
    """Every KV block is back: nothing runs, the books balance (read on the engine thread)."""
    engine = llm.engine
    # the server's engine thread runs the engine; between its steps nothing holds a block once all answered
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0


def test_openai_sdk_floats_base64_and_dimensions(embedding_setup, client):
    _, llm, reference = embedding_setup
    floats = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    assert [item.index for item in floats.data] == [0, 1, 2] and floats.model == "tiny-embed"
    for text, item in zip(TEXTS, floats.data):
        assert len(item.embedding) == HIDDEN_SIZE
        assert cosine(item.embedding, expected(llm, reference, text)) > 0.9999
    assert floats.usage.prompt_tokens == sum(len(llm.tokenizer.encode(text)) for text in TEXTS)
    assert floats.usage.total_tokens == floats.usage.prompt_tokens
    # The SDK asks for base64 when no format is given, and decodes it itself (little-endian float32).
    decoded = client.embeddings.create(model="tiny-embed", input=TEXTS)
    for base64_item, float_item in zip(decoded.data, floats.data):
        assert base64_item.embedding == pytest.approx(float_item.embedding, abs=1e-6)
    cut = client.embeddings.create(model="tiny-embed", input=TEXTS[1], dimensions=8, encoding_format="float")
    assert len(cut.data[0].embedding) == 8
    assert cosine(cut.data[0].embedding, expected(llm, reference, TEXTS[1], dimensions=8)) > 0.9999
    assert np.linalg.norm(cut.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    assert_clean(llm)


def test_raw_base64_is_little_endian_float32(embedding_setup, http):
    _, llm, reference = embedding_setup
    reply = http.post("/v1/embeddings", json={"input": [[5, 6, 7, 8]], "encoding_format": "base64"})
    assert reply.status_code == 200
    vector = np.frombuffer(base64.b64decode(reply.json()["data"][0]["embedding"]), dtype="<f4").copy()
    assert cosine(vector, reference_embedding(reference, [5, 6, 7, 8], "last")) > 0.9999
    assert reply.json()["usage"]["prompt_tokens"] == 4


def test_ollama_embed(embedding_setup):
    server, llm, reference = embedding_setup
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}")
    answer = client.embed(model="tiny-embed", input=TEXTS)
    assert len(answer.embeddings) == 3
    for text, vector in zip(TEXTS, answer.embeddings):
        assert cosine(vector, expected(llm, reference, text)) > 0.9999
    assert answer.prompt_eval_count == sum(len(llm.tokenizer.encode(text)) for text in TEXTS)
    single = client.embed(model="tiny-embed", input=TEXTS[0], dimensions=16)
    assert len(single.embeddings) == 1 and len(single.embeddings[0]) == 16
    assert cosine(single.embeddings[0], expected(llm, reference, TEXTS[0], dimensions=16)) > 0.9999
    assert_clean(llm)


def test_ollama_truncate(embedding_setup, http):
    _, llm, reference = embedding_setup
    long_text = " ".join(["hello"] * (MAX_MODEL_LEN + 5))
    cut = http.post("/api/embed", json={"model": "tiny-embed", "input": long_text})
    assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == MAX_MODEL_LEN
    tokens = llm.tokenizer.encode(long_text)[:MAX_MODEL_LEN]
    assert cosine(cut.json()["embeddings"][0], reference_embedding(reference, tokens, "last")) > 0.9999
    refused = http.post("/api/embed", json={"model": "tiny-embed", "input": long_text, "truncate": False})
    assert refused.status_code == 400 and "input[0]" in refused.json()["error"]
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=str(http.base_url)).embed(model="tiny-embed", input=[])
    assert caught.value.status_code == 400 and "'input'" in caught.value.error


def test_the_model_says_it_embeds(http):
    [model] = http.get("/v1/models").json()["data"]
    assert model["capabilities"] == ["embedding"]
    refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "model" and "embedding model" in refused.json()["error"]["message"]


# Each bound at its limit (accepted) and one past it (refused, naming the field); hostile shapes.
TOO_LONG = [4] * (MAX_MODEL_LEN + 1)
BOUNDS = [
    ({"input": [[4] * MAX_MODEL_LEN]}, None),
    ({"input": [TOO_LONG]}, "input[0]"),
    ({"input": [[1], TOO_LONG]}, "input[1]"),
    ({"input": ["hi"] * MAX_INPUTS}, None),
    ({"input": ["hi"] * (MAX_INPUTS + 1)}, "input"),
    ({"input": [[VOCAB_SIZE - 1]]}, None),
    ({"input": [[VOCAB_SIZE]]}, "input[0][0]"),
    ({"input": [[1, 2, 10**30]]}, "input[0][2]"),
    ({"input": [[-1]]}, "input[0][0]"),
    ({"input": "hi", "dimensions": HIDDEN_SIZE}, None),
    ({"input": "hi", "dimensions": HIDDEN_SIZE + 1}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": True}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": ""}, "input[0]"),
    ({"input": ["hi", ""]}, "input[1]"),
    ({"input": [[]]}, "input[0]"),
    ({}, "input"),
    ({"input": None}, "input"),
    ({"input": 5}, "input"),
    ({"input": {"text": "hi"}}, "input"),
    ({"input": [True]}, "input[0]"),
    ({"input": [1.5]}, "input[0]"),
    ({"input": [[1, [2]]]}, "input[0][1]"),
    ({"input": [[[1]]]}, "input[0][0]"),
    ({"input": ["hi", [1]], "encoding_format": "float"}, None),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "model": "other"}, "model"),
    ({"input": "hi", "temperature": 0}, "temperature"),
    ({"input": "   "}, "input[0]"),
]


@pytest.mark.parametrize(("body", "param"), BOUNDS)
def test_bounds_and_hostile_inputs(embedding_setup, http, body, param):
    _, llm, _ = embedding_setup
    reply = http.post("/v1/embeddings", json=body)
    if param is None:
        assert reply.status_code == 200, reply.text
    else:
        assert reply.status_code in (400, 404), reply.text
        assert reply.json()["error"]["param"] == param, reply.text
    assert_clean(llm)


@pytest.mark.parametrize(("body", "fragment"), [
    ({"input": ["hi"] * (MAX_INPUTS + 1)}, "'input'"),
    ({"input": ["hi", 3]}, "'input[1]'"),
    ({"input": [[1, 2]]}, "'input[0]'"),  # Ollama takes text only
    ({"input": "hi", "dimensions": HIDDEN_SIZE + 1}, "'dimensions'"),
    ({"input": "hi", "options": {"temperature": 0}}, "'options.temperature'"),
    ({"input": "hi", "format": "json"}, "format"),
])
def test_ollama_bounds(embedding_setup, http, body, fragment):
    _, llm, _ = embedding_setup
    reply = http.post("/api/embed", json={"model": "tiny-embed", **body})
    assert reply.status_code == 400 and fragment in reply.json()["error"], reply.text
    assert_clean(llm)


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.floats(allow_nan=True),
                      st.text(max_size=8))
INPUT = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=MAX_INPUTS + 2), max_leaves=20)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=INPUT)
@example(value=[[4] * MAX_MODEL_LEN] * MAX_INPUTS)
@example(value=[[4] * MAX_MODEL_LEN] * (MAX_INPUTS + 1))
@example(value=[[4] * (MAX_MODEL_LEN + 1)])
def test_generated_input_shapes_never_fail_the_server(embedding_setup, http, value):
    """Whatever `input` holds: a 200 with one vector per input, or a 400 naming `input` or one of its items."""
    _, llm, _ = embedding_setup
    reply = http.post("/v1/embeddings", content=json.dumps({"input": value, "encoding_format": "float"}).encode())
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        assert reply.json()["error"]["param"].startswith("input"), reply.text
    else:
        num_inputs = 1 if isinstance(value, str) or all(isinstance(v, int) for v in value) else len(value)
        assert len(reply.json()["data"]) == num_inputs
    assert_clean(llm)


BODIES = st.fixed_dictionaries({}, optional={
    "input": INPUT | nasty_text | st.lists(nasty_text, max_size=3),
    "model": maybe(st.sampled_from(["tiny-embed", "x"])),
    "dimensions": maybe(extreme_numbers | st.integers(-1, HIDDEN_SIZE + 1)),
    "encoding_format": maybe(st.sampled_from(["float", "base64", "int8"]) | nasty_text),
    "truncate": maybe(st.booleans() | json_values), "options": maybe(json_values), "user": maybe(nasty_text),
    "keep_alive": maybe(json_values), "stream": json_values})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/embeddings", "/api/embed"]), body=BODIES)
def test_generated_bodies_get_an_answer_or_a_4xx_in_the_routes_shape(embedding_setup, http, path, body):
    _, llm, _ = embedding_setup
    reply = http.post(path, content=json.dumps(body).encode())  # ASCII: lone surrogates travel escaped
    assert reply.status_code in (200, 400, 404), reply.text
    answer = reply.json()
    if reply.status_code != 200 and path == "/api/embed":
        assert set(answer) == {"error"} and isinstance(answer["error"], str)
    elif reply.status_code != 200:
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    elif path == "/api/embed":
        assert all(len(vector) == (body.get("dimensions") or HIDDEN_SIZE) for vector in answer["embeddings"])
    else:
        assert [item["index"] for item in answer["data"]] == list(range(len(answer["data"])))
    assert_clean(llm)


def test_a_generation_model_refuses_embeddings(tiny_chat_llm):
    with running_server(tiny_chat_llm) as server, httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as http:
        reply = http.post("/v1/embeddings", json={"input": "hello"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"
        assert "text generation model" in reply.json()["error"]["message"]
        ollama_reply = http.post("/api/embed", json={"model": "default", "input": "hello"})
        assert ollama_reply.status_code == 400 and "text generation model" in ollama_reply.json()["error"]
        [model] = http.get("/v1/models").json()["data"]
        assert "capabilities" not in model  # a generation model's object is OpenAI's, as before
