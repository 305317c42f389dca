"""The server's HTTP side and its safety: /health, /metrics, /v1/models, /slots, /v1/monitor; API key,
browser Origin, connection limit, and refusing to listen beyond loopback without a key."""

from __future__ import annotations

import asyncio
import io
import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from email.message import Message

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.helpers.server import CLOSING_EVENTS, collect_response, make_llm, running_server

API_KEY = "sekrit-key"


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    # a pool of its own: the prefix-cache test below needs its prompt not cached by an earlier file's requests
    with running_server(make_llm(tiny_chat_model_dir, max_model_len=512), model_alias="tiny-chat", max_connections=4,
                        allowed_origins=("http://localhost:3000",)) as server:
        yield server


def get(server, path: str, headers: dict | None = None) -> tuple[int, Message, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


async def respond_once(port: int, **headers) -> list[dict]:
    url = f"ws://127.0.0.1:{port}/v1/responses"
    async with connect(url, additional_headers=headers or None) as connection:
        await connection.send(json.dumps({"type": "response.create", "input": "hello world tell me a story",
                                          "max_output_tokens": 5}))
        return await collect_response(connection)


def metrics(server) -> dict[str, float]:
    status, headers, body = get(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            assert sample.labels.get("model_name") == "tiny-chat"
            if not sample.name.endswith("_bucket"):
                samples[sample.name] = sample.value
    return samples


def test_metrics_parse_and_move_as_requests_run(server):
    before = metrics(server)
    for name in ["kv_cache_usage_ratio", "num_requests_running", "num_requests_waiting",
                 "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"]:
        assert f"localserve_{name}" in before
    assert run(respond_once(server.port))[-1]["type"] in CLOSING_EVENTS
    after = metrics(server)
    for name in ["prefix_cache_queries_total", "prompt_tokens_total", "time_to_first_token_seconds_count",
                 "e2e_request_latency_seconds_count"]:
        assert after[f"localserve_{name}"] > before[f"localserve_{name}"], name
    for name in ["generation_tokens_total", "inter_token_latency_seconds_count"]:
        assert after[f"localserve_{name}"] >= before[f"localserve_{name}"] + 1, name


def test_health_models_slots_and_unknown_path(server):
    assert get(server, "/health")[:1] == (200,)
    status, _, body = get(server, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny-chat"
    status, headers, body = get(server, "/slots")
    slots = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert slots["blocks"]["num_blocks"] == 256 and slots["requests"] == []
    assert slots["blocks"]["num_used_blocks"] == 0
    status, _, body = get(server, "/nope")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_monitor_sends_snapshots_of_every_block(server):
    async def main():
        async with connect(f"ws://127.0.0.1:{server.port}/v1/monitor?interval=0.05") as monitor:
            return [json.loads(await monitor.recv()) for _ in range(4)]

    hello, *snapshots = run(main())
    assert hello["type"] == "monitor.hello" and hello["num_blocks"] == 256
    assert [s["type"] for s in snapshots] == ["monitor.snapshot"] * 3
    for snapshot in snapshots:
        states = "".join(char * int(count or 1) for char, count in re.findall(r"([.cus])(\d*)", snapshot["blocks"]))
        assert len(states) == 256
    assert snapshots[-1]["time"] > snapshots[0]["time"]
    assert {"num_preemptions", "prefix_hit_tokens", "num_generation_tokens"} <= set(snapshots[0]["counters"])


def test_monitor_reports_admission_prefix_hits_and_finishing(server):
    story = {"type": "response.create", "temperature": 0, "max_output_tokens": 40,
             "input": "hello world tell me a story about the cat and the dog in the city by the river"}

    async def main():
        async with connect(f"ws://127.0.0.1:{server.port}/v1/monitor?interval=0.05") as monitor:
            await monitor.recv()
            async with connect(f"ws://127.0.0.1:{server.port}/v1/responses") as client:
                for _ in range(2):  # the same prompt twice: the second finds it in the prefix cache
                    await client.send(json.dumps(story))
                    await collect_response(client)
            events = []
            while sum(event["event"] == "finished" for event in events) < 2:
                events += json.loads(await monitor.recv())["events"]
            return events

    events = run(main())
    admitted = [event["request"] for event in events if event["event"] == "admitted"]
    assert len(admitted) == 2
    hits = [event for event in events if event["event"] == "prefix_hit"]
    assert [hit["request"] for hit in hits] == admitted[1:] and hits[0]["num_cached_tokens"] >= 16


def test_chat_client_holds_a_conversation(server):
    from localserve.chat.client import run_chat

    out = io.StringIO()
    assert run_chat(f"127.0.0.1:{server.port}", lines=io.StringIO("hello world\n\nand the cat\n"), out=out,
                    max_output_tokens=3, temperature=0) == 0
    assert out.getvalue().count("\n") == 2  # two replies
    conversations = server.server.conversations
    stored = max((conversations.get(key, "any connection") for key in list(conversations._entries)), key=len)
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[2]["content"] == "and the cat"


def test_foreign_origin_is_refused_own_and_allowed_origins_are_not(server):
    async def origin_status(origin: str) -> int:
        try:
            async with connect(f"ws://127.0.0.1:{server.port}/v1/responses", origin=origin):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code

    async def main():
        return [await origin_status(origin) for origin in (
            "http://evil.example", "http://127.0.0.1:1", "null", f"http://127.0.0.1:{server.port}",
            f"http://localhost:{server.port}", "http://localhost:3000")]

    assert run(main()) == [403, 403, 403, 101, 101, 101]
    assert get(server, "/slots", {"Origin": "http://evil.example"})[0] == 403


def test_connections_beyond_the_limit_get_429(server):
    async def main():
        url = f"ws://127.0.0.1:{server.port}/v1/responses"
        held = [await connect(url) for _ in range(4)]
        for connection in held:  # a websocket holds a place once it has spoken (a silent one is unfinished)
            await connection.send(json.dumps({"type": "response.cancel"}))
            assert json.loads(await connection.recv())["error"]["code"] == "response_cancel_not_active"
        try:
            with pytest.raises(InvalidStatus) as refused:
                await connect(url)
            return refused.value.response.status_code
        finally:
            for connection in held:
                await connection.close()

    assert run(main()) == 429  # OpenAI's status for "saturated, retry later"


@pytest.fixture(scope="module")
def keyed_server(tiny_chat_llm, server):  # after `server`: one engine thread at a time
    with running_server(tiny_chat_llm, api_key=API_KEY) as keyed:
        yield keyed


def test_missing_or_wrong_key_gets_401_before_the_upgrade(keyed_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, response_headers, body = get(keyed_server, "/v1/models", headers)
        assert status == 401 and response_headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert get(keyed_server, "/v1/models", {"Authorization": f"Bearer {API_KEY}"})[0] == 200
    assert get(keyed_server, "/health")[0] == 200  # liveness stays open
    with pytest.raises(InvalidStatus) as refused:
        run(respond_once(keyed_server.port))
    assert refused.value.response.status_code == 401
    events = run(respond_once(keyed_server.port, Authorization=f"Bearer {API_KEY}"))
    assert events[-1]["type"] in CLOSING_EVENTS


def test_sdk_with_the_key_connects_and_without_it_fails(keyed_server):
    async def main(api_key: str):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{keyed_server.port}/v1", api_key=api_key)
        async with client.responses.connect() as connection:
            await connection.response.create(input="hi", max_output_tokens=2)
            async for event in connection:
                if event.type in CLOSING_EVENTS:
                    return event.type

    assert run(main(API_KEY)) in CLOSING_EVENTS
    with pytest.raises(InvalidStatus):
        run(main("wrong"))


def test_listening_beyond_loopback_without_a_key_refuses_to_start(capsys, tmp_path):
    from localserve.cli import main
    from localserve.server.app import LocalServer
    from localserve.server.config import ServerConfig
    from localserve.server.wire.access import check_bind_safety

    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0.*--api-key"):
        LocalServer(None, ServerConfig(host="0.0.0.0"))  # refused before it looks at the models
    check_bind_safety(ServerConfig(host="0.0.0.0", api_key="k"))  # with a key it may
    # The CLI refuses before loading the model: the missing model folder is never looked at.
    assert main(["serve", "--host", "0.0.0.0", "-m", str(tmp_path / "missing")]) == 2
    error = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0" in error and "--api-key" in error and "missing" not in error


def test_serve_command_serves_until_interrupted(tiny_chat_model_dir):
    command = [sys.executable, "-m", "localserve.cli", "serve", "-m", str(tiny_chat_model_dir),
               "--device", "cpu", "--port", "0", "--alias", "tiny-cli", "--num-kv-blocks", "64"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if found := re.search(r"serving tiny-cli on ws://127\.0\.0\.1:(\d+)/v1/responses", line):
                break
        assert found, "the server never said where it listens"
        with urllib.request.urlopen(f"http://127.0.0.1:{found[1]}/v1/models", timeout=30) as response:
            assert json.loads(response.read())["data"][0]["id"] == "tiny-cli"
        events = run(respond_once(int(found[1])))
        assert events[-1]["type"] in CLOSING_EVENTS
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        process.wait()
