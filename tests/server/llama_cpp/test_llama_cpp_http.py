"""llama.cpp's own endpoints over raw HTTP (tiny model): /tokenize (with and without pieces, special tokens
added or not), /detokenize, /apply-template and /props, against the model's tokenizer and the engine's
settings; refusals in OpenAI's error shape, as llama.cpp's server answers them. A token's piece is its
bytes where they are not whole UTF-8 (a byte-level tokenizer splitting a character)."""

from __future__ import annotations

import http.client
import json

import pytest

from localserve.server.llama_cpp.api import token_piece
from localserve.server.request.generation_request import RequestLimits
from localserve.tokenizer.tokenizer import Tokenizer
from tests.helpers.http_api import Api, response, run
from tests.helpers.server import running_server

TEXT = "hello world tell me a story"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, model_alias="tiny-chat") as server:
        yield server


def call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request(method, path, json.dumps(body) if body is not None else None,
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    status, data = response.status, json.loads(response.read())
    connection.close()
    return status, data


def test_tokenize_gives_the_tokenizers_ids_and_pieces(server, tiny_chat_llm):
    tokenizer = tiny_chat_llm.tokenizer
    status, plain = call(server.port, "POST", "/tokenize", {"content": TEXT})
    assert status == 200 and plain == {"tokens": tokenizer.encode(TEXT, add_special_tokens=False)}
    status, special = call(server.port, "POST", "/tokenize", {"content": TEXT, "add_special": True})
    assert special["tokens"] == tokenizer.encode(TEXT, add_special_tokens=True)
    status, pieces = call(server.port, "POST", "/tokenize", {"content": TEXT, "with_pieces": True})
    assert [piece["id"] for piece in pieces["tokens"]] == plain["tokens"]
    assert [piece["piece"] for piece in pieces["tokens"]] == TEXT.split()  # a word-level vocabulary
    status, marked = call(server.port, "POST", "/tokenize", {"content": "<|im_start|>user"})
    assert marked["tokens"][0] == tokenizer.token_to_id("<|im_start|>")  # parse_special: true, as llama.cpp's default


def test_detokenize_is_the_inverse(server, tiny_chat_llm):
    ids = tiny_chat_llm.tokenizer.encode(TEXT, add_special_tokens=False)
    status, text = call(server.port, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and text == {"content": tiny_chat_llm.tokenizer.decode(ids, skip_special_tokens=False)}
    assert text["content"] == TEXT
    assert call(server.port, "POST", "/detokenize", {"tokens": []}) == (200, {"content": ""})


def test_apply_template_renders_as_the_chat_endpoint_would(server, tiny_chat_llm):
    status, rendered = call(server.port, "POST", "/apply-template", {"messages": MESSAGES})
    assert status == 200 and rendered == {"prompt": tiny_chat_llm.tokenizer.apply_chat_template(MESSAGES)}
    assert rendered["prompt"].endswith("<|im_start|>assistant\n")
    # the prompt's tokens are the ones a chat completion reads
    status, completion = call(server.port, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert completion["usage"]["prompt_tokens"] == len(tiny_chat_llm.tokenizer.encode_chat(MESSAGES))


def test_props_tell_the_servers_settings(server, tiny_chat_llm):
    status, props = call(server.port, "GET", "/props")
    assert status == 200
    assert props["default_generation_settings"]["n_ctx"] == tiny_chat_llm.engine.max_model_len == 512
    assert props["total_slots"] == 16 and props["model_alias"] == "tiny-chat"
    assert props["chat_template"] == tiny_chat_llm.tokenizer.chat_template
    assert props["model_path"] == str(tiny_chat_llm.model_path)
    assert props["modalities"] == {"vision": False, "audio": False}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special"),
    ("/tokenize", {"content": "x", "model": "other"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
    ("/detokenize", {"tokens": [256]}, "tokens[0]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    ("/apply-template", {}, "messages"),
    ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
])
def test_refusals_name_the_field(server, path, body, param):
    status, answer = call(server.port, "POST", path, body)
    assert status in (400, 404) and answer["error"]["param"] == param, answer


def test_detokenize_bounds_the_token_count():
    api = Api(limits=RequestLimits(max_input_chars=8))
    peer = run(api.call("POST", "/detokenize", {"tokens": [1] * 9}))
    status, _, body = response(peer)
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"
    status, _, body = response(run(api.call("POST", "/detokenize", {"tokens": [1] * 8})))
    assert status == 200 and json.loads(body) == {"content": "<1>" * 8}  # the played tokenizer's text


def test_a_piece_is_its_bytes_where_they_are_not_whole_utf8(grammar_model_dir):
    tokenizer = Tokenizer.from_path(grammar_model_dir)
    text = "é€😀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [token_piece(tokenizer, token_id) for token_id in ids]
    raw = b"".join(piece.encode() if isinstance(piece, str) else bytes(piece) for piece in pieces)
    assert raw.decode() == text
    assert any(isinstance(piece, list) for piece in pieces)  # a character split across tokens
