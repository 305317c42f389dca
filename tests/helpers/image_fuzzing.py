"""The image fuzzers' run against a model that takes images (a tiny Gemma 3): requests holding image parts
(tests/helpers/image_parts.py) to every API, each with what the server must make of it.

A drawn request is a `VisionCase`: the API's path and body, and its oracle. The server checks a request's
images in the order they stand (counted before each is decoded), so the first part that is wrong, or that
crosses a request's bound, is the one its 400 names (with its documented code: docs/PROTOCOL.md's "Images"); a
request whose parts are all right is answered (200). `VisionFuzzer` sends the cases through the HTTP fuzzers'
own senders (their checks of each answer) or over the Responses websocket, by clients that read to the end,
vanish mid-stream, never read, or come six at once.
"""

from __future__ import annotations

import http.client
import itertools
import json
import re
import socket
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from hypothesis import strategies as st

from tests.helpers.image_parts import (
    IMAGE_CODES,
    VISION_BOUNDS,
    anthropic_image_block,
    base64_image,
    chat_image_part,
    responses_image_part,
)
from tests.helpers.server import CLOSING_EVENTS

# text around the images: typed image and turn tokens among it (a typed marker is no image)
HOSTILE_TEXTS = st.text(max_size=12) | st.sampled_from([
    "<start_of_image>", "<image_soft_token>" * 3, "<end_of_image>", "<start_of_turn>user\n", "<end_of_turn>", "",
    "\x00", "\ud800", "é" * 30, "what is in the picture?"])


# ---------------------------------------------------------------------------------- requests and their oracle
@dataclass(frozen=True)
class VisionCase:
    """A request with image parts and what must come of it: 200 (`refused_at` None), or a 4xx whose `param` names
    one of `refused_at`'s parts (JSON paths) with one of its codes."""

    path: str
    body: dict
    refused_at: tuple[tuple[str, frozenset[str]], ...] | None
    # where the chat template may refuse a request whose parts are all right (`invalid_prompt`): images in a
    # system or assistant turn, which Gemma 3's template drops (naming the image) or fails on (naming the field)
    may_refuse: tuple[str, ...] = ()

    def check_refusal(self, status: int, code: str | None, param: str | None) -> None:
        """A refusal by the rules: expected, with a documented code, naming the part that is wrong."""
        refused_at = self.refused_at or tuple((where, frozenset({"invalid_prompt"})) for where in self.may_refuse)
        assert refused_at, f"a request the server must answer was refused: {status} {code} {param}"
        assert 400 <= status < 500 and code in IMAGE_CODES, (status, code, param)
        assert param is not None and any(re.match(re.escape(where) + r"($|\.)", param) and code in codes
                                         for where, codes in refused_at), (code, param, refused_at)

    def encoded(self) -> tuple[str, bytes]:
        return self.path, json.dumps(self.body).encode()


def _oracle(parts: list[tuple[str, frozenset[str], int | None]], texts: list[tuple[str, str]]) \
        -> tuple[tuple[str, frozenset[str]], ...] | None:
    """Where the refusal must point for `parts` ((where, own codes, file size) in the order the server reads
    them) and `texts` ((where, text)): a text holding a lone surrogate (the body is checked for those first);
    else the first part that is wrong on its own, is past the request's count, or brings its bytes past the
    request's total; None when every part is right."""
    invalid = _surrogates(texts)
    if invalid:
        return invalid
    total = 0
    for number, (where, codes, size) in enumerate(parts):
        codes = set(codes)
        if number >= VISION_BOUNDS.max_images:
            codes.add("too_many_images")
        if size is not None and not codes and total + size > VISION_BOUNDS.max_total_bytes:
            codes.add("image_too_large")
        if codes:
            return ((where, frozenset(codes)),)
        total += size or 0
    return None


def _surrogates(texts: list[tuple[str, str]]) -> tuple[tuple[str, frozenset[str]], ...]:
    """The texts holding a lone surrogate (invalid Unicode: refused before anything else is read)."""
    return tuple((where, frozenset({"invalid_value"})) for where, text in texts
                 if any(0xD800 <= ord(character) <= 0xDFFF for character in text))


def _text(draw, where: str, texts: list[tuple[str, str]]) -> str:
    """A hostile text at `where`, noted in `texts`."""
    text = draw(HOSTILE_TEXTS)
    texts.append((where, text))
    return text


def _content(draw, part_strategy, right, where: str, text_type: str, counts: list[int], texts: list) \
        -> tuple[list, list]:
    """A message's content: text parts of hostile text and image parts (each drawn from `part_strategy(right())`,
    `right()` saying whether it is drawn right; `counts`: how many), in any order."""
    count = draw(st.sampled_from(counts))
    kinds = draw(st.permutations(["image"] * count + ["text"] * draw(st.integers(0, 2))))
    content, parts = [], []
    for kind in kinds:
        if kind == "text":
            content.append({"type": text_type, "text": _text(draw, f"{where}.content[{len(content)}]", texts)})
            continue
        part, codes, size = draw(part_strategy(right()))
        parts.append((f"{where}.content[{len(content)}]", codes, size))
        content.append(part)
    return content, parts


OPENAI_CONTENT = ("chat", "apply_template", "responses", "responses_socket")  # images in any role's content


def _roles(draw, api: str, clean: bool) -> list[str]:
    """The turns of a conversation Gemma 3's template takes (alternating, ending with the user's); now and then a
    system turn first (OpenAI's)."""
    turns = 1 if clean else draw(st.sampled_from([1, 1, 3]))
    roles = ["user" if turn % 2 == 0 else "assistant" for turn in range(turns)]
    if not clean and api in OPENAI_CONTENT and draw(st.integers(0, 3)) == 0:
        roles.insert(0, draw(st.sampled_from(["system", "developer"])))
    return roles


@st.composite
def vision_cases(draw, apis: tuple[str, ...]) -> VisionCase:
    """A request with image parts to one of `apis` ("chat", "apply_template", "responses", "responses_socket" (a
    follow-up of the last stored response now and then), "ollama_chat", "ollama_generate", "anthropic",
    "anthropic_count"), in a conversation Gemma 3's template takes (turns that alternate, ending with
    the user's; images in user turns, and in system and assistant turns on OpenAI's APIs). Half the cases hold
    only valid pictures, rightly sent, within the bounds; in the others about a third of the parts are wrong."""
    api = draw(st.sampled_from(apis))
    clean = draw(st.booleans())
    counts = [1, 1, 2, 3] if clean else [1, 1, 2, 4, 12]
    stream = draw(st.booleans())
    texts: list[tuple[str, str]] = []

    def right() -> bool:  # whether the next part is drawn right
        return clean or draw(st.integers(0, 2)) > 0

    if api == "ollama_generate":
        images = [draw(base64_image(right())) for _ in range(draw(st.sampled_from(counts)))]
        parts = [(f"images[{number}]", codes, size) for number, (_, codes, size) in enumerate(images)]
        body = {"model": "served", "prompt": _text(draw, "prompt", texts), "images": [text for text, _, _ in images],
                "stream": stream, "options": {"num_predict": draw(st.integers(1, 3))}}
        if not clean and draw(st.integers(0, 5)) == 0:  # images with a raw prompt: refused, naming images[0]
            body["raw"] = True
            bounds = {"invalid_prompt", "too_many_images", "image_too_large"}
            raw = tuple((where, codes | bounds) for where, codes, _ in parts)
            return VisionCase("/api/generate", body, _surrogates(texts) or raw)
        return VisionCase("/api/generate", body, _oracle(parts, texts))
    messages, parts, may_refuse = [], [], []
    for turn, role in enumerate(_roles(draw, api, clean)):
        where = f"{'input' if api.startswith('responses') else 'messages'}[{turn}]"
        if role == "assistant" and (api not in OPENAI_CONTENT or draw(st.booleans())):
            messages.append({"role": "assistant", "content": _text(draw, f"{where}.content", texts)})
            continue
        if api == "ollama_chat":
            images = [draw(base64_image(right())) for _ in range(draw(st.sampled_from(counts)))]
            parts += [(f"{where}.images[{number}]", codes, size) for number, (_, codes, size) in enumerate(images)]
            messages.append({"role": "user", "content": _text(draw, f"{where}.content", texts),
                             "images": [text for text, _, _ in images]})
            continue
        strategy, text_type = (responses_image_part, "input_text") if api.startswith("responses") else (
            (anthropic_image_block, "text") if api.startswith("anthropic") else (chat_image_part, "text"))
        content, found = _content(draw, strategy, right, where, text_type, counts, texts)
        parts += found
        if role != "user":  # images where Gemma 3's template may drop them, or fail
            may_refuse += [where for where, _, _ in found] + [where.split("[")[0]]
        messages.append({"role": role, "content": content})
    limit = draw(st.integers(1, 3))
    if api == "chat":
        path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": limit, "stream": stream}
    elif api == "apply_template":  # renders the markers: no image dropped is refused here
        path, body = "/apply-template", {"messages": messages}
        may_refuse = [where for where in may_refuse if "[" not in where]
    elif api == "anthropic_count":
        path, body = "/v1/messages/count_tokens", {"messages": messages}
    elif api.startswith("responses"):
        path, body = "/v1/responses", {"input": messages, "max_output_tokens": limit, "stream": stream}
        if api == "responses_socket":
            path, body = "ws:/v1/responses", {"type": "response.create", "input": messages, "max_output_tokens": limit,
                                              "store": True}
            if messages[0]["role"] == "user" and draw(st.integers(0, 2)) == 0:
                body["previous_response_id"] = "@last"  # the last stored response (not itself a follow-up)
    elif api == "anthropic":
        path, body = "/v1/messages", {"messages": messages, "max_tokens": limit, "stream": stream}
    else:
        path, body = "/api/chat", {"messages": messages, "stream": stream, "options": {"num_predict": limit}}
    return VisionCase(path, {"model": "served", **body}, _oracle(parts, texts), tuple(may_refuse))


class VisionFuzzer:
    """Sends `VisionCase`s through one of the fuzzers (its own checks of each answer), checking each refusal
    against the case's oracle. `drop_after` 0: a client that sends and never reads (its connection left open
    until `close_idle`); BURST: six clients send it at once."""

    def __init__(self, fuzzer, port: int) -> None:
        self.fuzzer = fuzzer
        self.port = port
        self.idle: list = []  # the connections of clients that never read
        self.socket = None  # a Responses websocket, kept open across its cases
        self.connections = ExitStack()  # every websocket opened
        self.socket_outcomes: Counter[str] = Counter()
        self.burst_outcomes: Counter[int] = Counter()  # the statuses of the bursts' answers
        self.last_response_id: str | None = None
        self.refused = 0
        self.never_read = 0

    def send(self, case: VisionCase, drop_after: int | None) -> None:
        path, body = case.encoded()
        if path.startswith("ws:"):
            return self.send_event(case, drop_after if drop_after != BURST else None)
        if drop_after == BURST:
            return self.send_burst(case, path, body)
        if drop_after == 0:
            self.never_read += 1
            client = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            client.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            self.idle.append(client)
            return
        seen = len(self.fuzzer.refusals)
        self.fuzzer.send(path, body, drop_after)
        for status, code, param in self.fuzzer.refusals[seen:]:
            self.refused += 1
            case.check_refusal(status, code, param)
        if len(self.fuzzer.refusals) == seen:
            assert case.refused_at is None, f"a request the server must refuse was answered: {case.refused_at}"

    def send_burst(self, case: VisionCase, path: str, body: bytes, clients: int = 6) -> None:
        """The request sent by `clients` clients at once (each on its connection, all sent before any is read),
        then each answer read whole: a 200, or the case's refusal."""
        connections = [http.client.HTTPConnection("127.0.0.1", self.port, timeout=60) for _ in range(clients)]
        try:
            for connection in connections:
                connection.request("POST", path, body, {"Content-Type": "application/json"})
            for connection in connections:
                response = connection.getresponse()
                data = response.read()
                self.burst_outcomes[response.status] += 1
                if response.status == 200:
                    assert case.refused_at is None, f"a request the server must refuse was answered: {case.refused_at}"
                    continue
                error = json.loads(data)
                inner = error if path.startswith("/api/") else error["error"]
                self.refused += 1
                case.check_refusal(response.status, inner.get("code"), inner.get("param"))
        finally:
            for connection in connections:
                connection.close()

    def send_event(self, case: VisionCase, drop_after: int | None) -> None:
        """A `response.create` event over the Responses websocket (`@last`: the last stored response's id, left out
        while there is none); its events read to the closing one or an error (or `drop_after` of them, then the
        connection closed)."""
        from websockets.sync.client import connect

        event, follow_up = dict(case.body), "previous_response_id" in case.body
        if follow_up:
            event["previous_response_id"] = self.last_response_id
            if self.last_response_id is None:
                del event["previous_response_id"]

        if self.socket is None:  # closed by close_idle at the latest
            self.socket = self.connections.enter_context(connect(f"ws://127.0.0.1:{self.port}/v1/responses",
                                                                 max_size=None))
        self.socket.send(json.dumps(event))
        if drop_after == 0:
            self.never_read += 1
            self.idle.append(self.socket)
            self.socket = None
            return
        for count in itertools.count(1):
            answer = json.loads(self.socket.recv(timeout=60))
            if answer["type"] == "error":
                self.refused += 1
                self.socket_outcomes["error"] += 1
                return case.check_refusal(answer["status"], answer["error"]["code"], answer["error"]["param"])
            assert answer["type"] != "response.failed", answer
            if answer["type"] in CLOSING_EVENTS:
                assert case.refused_at is None, f"a request the server must refuse was answered: {case.refused_at}"
                self.socket_outcomes["follow-up" if follow_up else "answer"] += 1
                if not follow_up:
                    self.last_response_id = answer["response"]["id"]
                return None
            if drop_after is not None and count >= drop_after:
                self.socket_outcomes["dropped"] += 1
                return self.reconnect()
        return None

    def reconnect(self) -> None:
        self.fuzzer.reconnect()
        if self.socket is not None:
            self.socket.close()
            self.socket = None

    def close_idle(self) -> None:
        """Close the connections of the clients that never read, and every websocket."""
        for client in self.idle:
            client.close()
        self.idle.clear()
        self.connections.close()
        self.socket = None


@contextmanager
def vision_fuzz_server(llm, **config):
    """A server for the tiny vision `llm` under VISION_BOUNDS, as the fuzzers run it (served as "served")."""
    from localserve.server.request.generation_request import RequestLimits
    from tests.helpers.server import running_server

    with running_server(llm, model_alias="served", default_max_output_tokens=3, send_timeout_s=5.0,
                        limits=RequestLimits(images=VISION_BOUNDS), **config) as server:
        yield server


def run_vision_fuzz(fuzzer, server, apis: tuple[str, ...], num_cases: int) -> VisionFuzzer:
    """`num_cases` of `vision_cases(apis)` sent through `fuzzer` (one of the HTTP fuzzers, with its own checks of
    each answer) to `server` (`vision_fuzz_server`), by clients that read to the end, vanish or never read; then
    the server whole (the engine idle, every block back, no exchange in flight) and its image embeddings cache
    within its bound. Returns the VisionFuzzer, for its counts."""
    from tests.helpers.fuzzing import assert_server_whole, send_generated_requests

    vision = VisionFuzzer(fuzzer, server.port)
    send_generated_requests(vision, vision_cases(apis).map(lambda case: (case,)), num_cases, drops=VISION_DROPS)
    vision.reconnect()
    vision.close_idle()
    assert vision.refused >= 5, vision.refused
    assert_server_whole(server)
    assert_embeddings_cache_bounded(server)
    return vision


def assert_embeddings_cache_bounded(server) -> None:
    """The image embeddings cache within its bound, after encoding images and finding some again."""
    cache = server.server.models.serving_now().engine.engine.runner.image_embeds
    assert cache.num_encoded > 0 and cache.num_hits > 0 and cache.num_bytes <= cache.max_bytes, \
        (cache.num_encoded, cache.num_hits, cache.num_bytes)


# the clients: read to the end (None), vanish after 1-3 reads, never read (0), or six at once (BURST)
BURST = -1
VISION_DROPS = st.sampled_from([None, None, None, None, 1, 2, 3, 0, BURST])
