"""The HTTP API (server/http_app.py) as an ASGI app on its own: driven through a minimal ASGI pair
(tests/helpers/asgi.py), its responses run by a real GenerationService on a recorded engine thread
(tests/helpers/engine_access.py); no socket, no model. The order of the checks (the health probe before
access, access before anything else, the connection limit, the shutdown), the routes and their
refusals (404, 405, 426), the plain GETs, a whole and a streamed answer, a client that leaves (its
request aborted), `store: false` kept for its own request only, a shutdown mid-answer, and a bug in a
handler answered with a 500 once, or a reset when the answer had begun."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.asgi import AsgiPeer, body_messages
from tests.helpers.http_api import API_KEY, KEY, ORIGIN, Api, run, until

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def error_of(peer: AsgiPeer) -> tuple[int, str]:
    return peer.status, peer.json()["error"]["code"]


# ------------------------------------------------------------------ the order of the checks
def test_the_health_probe_needs_no_key_and_everything_else_does():
    api = Api(api_key=API_KEY)
    health = api.get("/health")
    assert (health.status, health.json()) == (200, {"status": "ok"})
    refused = api.get("/v1/models")
    assert error_of(refused) == (401, "invalid_api_key") and refused.headers[b"www-authenticate"] == b"Bearer"
    assert api.get("/v1/models", KEY).status == 200
    assert error_of(api.get("/nope")) == (401, "invalid_api_key")  # before the path is looked at


def test_a_preflight_needs_no_key_but_an_allowed_origin():
    api = Api(api_key=API_KEY)
    preflight = run(api.call("OPTIONS", "/v1/chat/completions", headers={"Origin": ORIGIN}))
    assert preflight.status == 204 and preflight.headers[b"access-control-allow-origin"] == ORIGIN.encode()
    assert b"POST" in preflight.headers[b"access-control-allow-methods"]
    foreign = run(api.call("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://evil.example"}))
    assert error_of(foreign) == (403, "origin_not_allowed") and b"access-control-allow-origin" not in foreign.headers


def test_an_allowed_origin_gets_cors_headers_on_every_answer_errors_included():
    api = Api()
    assert api.get("/v1/models", {"Origin": ORIGIN}).headers[b"access-control-allow-origin"] == ORIGIN.encode()
    missing = api.get("/nope", {"Origin": ORIGIN})
    assert error_of(missing) == (404, "not_found") and missing.headers[b"vary"] == b"Origin"
    assert b"access-control-allow-origin" not in api.get("/v1/models").headers


def test_a_connection_over_the_limit_is_a_429_that_closes_without_reading_the_body():
    api = Api()
    peer = AsgiPeer(body_messages(json.dumps(CHAT).encode()), over_limit=True)
    run(api.call("POST", "/v1/chat/completions", peer=peer))
    assert error_of(peer) == (429, "too_many_connections") and peer.json()["error"]["type"] == "rate_limit_error"
    assert peer.headers[b"connection"] == b"close" and peer.num_received == 0 and api.engine.submissions == []


def test_once_shutting_down_only_the_health_probe_answers():
    api = Api()
    api.app.shut_down()
    assert api.get("/health").status == 200
    assert error_of(api.get("/v1/models")) == (503, "server_shutdown")
    assert error_of(run(api.call("POST", "/v1/chat/completions", CHAT))) == (503, "server_shutdown")
    assert api.engine.submissions == []


# ------------------------------------------------------------------ routes
@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/models/gpt-4o", 404, "model_not_found"),
    ("GET", "/v1/responses", 426, "websocket_required"), ("GET", "/v1/monitor", 426, "websocket_required"),
    ("POST", "/v1/monitor", 405, "method_not_allowed"), ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/responses", 405, "method_not_allowed"), ("POST", "/metrics", 405, "method_not_allowed"),
    ("GET", "/nope", 404, "not_found"), ("GET", "/v1/models/", 404, "model_not_found"),
])
def test_refused_routes(method, path, status, code):
    assert error_of(run(Api().call(method, path))) == (status, code)


def test_models_lists_the_served_model_and_answers_to_its_names():
    api = Api()
    listed = api.get("/v1/models").json()
    assert listed["object"] == "list" and [model["id"] for model in listed["data"]] == ["served"]
    assert api.get("/v1/models/served").json() == listed["data"][0] == api.get("/v1/models/model").json()


def test_metrics_are_the_prometheus_text_of_the_engine_stats():
    metrics = Api().get("/metrics")
    assert metrics.status == 200 and metrics.headers[b"content-type"].startswith(b"text/plain; version=0.0.4")
    assert int(metrics.headers[b"content-length"]) == len(metrics.body)
    samples = {sample.name: sample.value for family in text_string_to_metric_families(metrics.body.decode())
               for sample in family.samples}
    assert samples["localserve_generation_tokens_total"] == 0 and samples["localserve_kv_cache_usage_ratio"] == 0


def test_slots_show_the_pool_from_the_engines_snapshot():
    slots = Api().get("/slots").json()
    assert slots["max_num_seqs"] == 16 and slots["requests"] == []
    assert slots["blocks"]["num_blocks"] == 64 and slots["blocks"]["num_free_blocks"] == 64


def unloaded_mid_read(api: Api) -> None:
    """The model is unloaded while its engine is being read: its thread answers EngineStopped."""
    from concurrent.futures import Future

    def stopped_read(*args) -> Future:
        api.app.models.unload_all()
        future: Future = Future()
        future.set_exception(RuntimeError("the engine thread has stopped"))
        return future

    api.engine.stats = api.engine.snapshot_and_events = stopped_read


def test_metrics_read_while_the_model_unloads_are_the_servers_own_at_once():
    api = Api()
    unloaded_mid_read(api)
    metrics = api.get("/metrics")
    assert metrics.status == 200
    names = {family.name for family in text_string_to_metric_families(metrics.body.decode())}
    assert "localserve_num_connections" in names and "localserve_kv_cache_usage_ratio" not in names


def test_slots_read_while_the_model_unloads_say_no_model_is_loaded():
    api = Api()
    unloaded_mid_read(api)
    slots = api.get("/slots")
    assert slots.status == 503 and slots.json()["error"]["code"] == "no_model_loaded"


# ------------------------------------------------------------------ generation
def test_a_whole_chat_completion_and_a_whole_response():
    async def main():
        api = Api()
        chat = await api.answered("/v1/chat/completions", CHAT, ["Hel", "lo"])
        responses = await api.answered("/v1/responses", {"input": "hi"}, ["Hi", "!"])
        return chat, responses

    chat, responses = run(main())
    assert chat.status == 200 and chat.json()["choices"][0]["message"]["content"] == "Hello"
    assert chat.json()["choices"][0]["finish_reason"] == "stop"
    assert responses.status == 200 and responses.json()["status"] == "completed"
    assert responses.json()["output"][0]["content"][0]["text"] == "Hi!"


def test_a_streamed_chat_completion_is_server_sent_events_ending_in_done():
    async def main():
        api = Api()
        return await api.answered("/v1/chat/completions", {**CHAT, "stream": True}, ["Hel", "lo"])

    peer = run(main())
    assert peer.status == 200 and peer.headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert peer.headers[b"cache-control"] == b"no-cache"
    *chunks, done = peer.event_data()
    assert done == "[DONE]" and all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"]) == "Hello"
    assert peer.sent[-1]["more_body"] is False


def test_a_streamed_response_names_each_event():
    async def main():
        return await Api().answered("/v1/responses", {"input": "hi", "stream": True}, ["a"])

    peer = run(main())
    events = [line[len("event: "):] for line in peer.body.decode().split("\n") if line.startswith("event: ")]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert events == [event["type"] for event in peer.event_data()]


def test_a_client_that_leaves_mid_answer_has_its_request_aborted():
    async def main():
        api = Api()
        peer = AsgiPeer([*body_messages(json.dumps(CHAT).encode()), {"type": "http.disconnect"}],
                        delays_s=[0.0, 0.05])
        await api.call("POST", "/v1/chat/completions", peer=peer)
        return api, peer

    api, peer = run(main())
    assert api.engine.aborted == [api.engine.submissions[0].request_id]
    assert peer.sent == [] and api.responses.num_running == 0 and api.app.in_flight == set()


def test_a_store_false_response_is_kept_for_its_own_request_only():
    async def main():
        api = Api()
        stored = (await api.answered("/v1/responses", {"input": "hi"}, ["a"])).json()["id"]
        private = (await api.answered("/v1/responses", {"input": "hi", "store": False}, ["a"])).json()["id"]
        assert len(api.responses.conversations) == 1  # the private one went with its request
        follow_ups = []
        for previous in (stored, private):
            follow_ups.append(await api.answered("/v1/responses", {"input": "more", "previous_response_id": previous},
                                                 ["b"]))
        return follow_ups

    continued, refused = run(main())
    assert continued.status == 200 and continued.json()["status"] == "completed"
    assert error_of(refused) == (400, "previous_response_not_found")


def test_a_shutdown_mid_answer_ends_each_answer_with_its_reason():
    async def main():
        api = Api()
        calls = [asyncio.create_task(api.call("POST", path, body)) for path, body in (
            ("/v1/chat/completions", CHAT), ("/v1/responses", {"input": "hi"}),
            ("/v1/chat/completions", {**CHAT, "stream": True}))]
        await until(lambda: len(api.engine.submissions) == 3)
        api.app.shut_down()
        peers = await asyncio.gather(*calls)
        return api, peers

    api, (chat, responses, streamed) = run(main())
    assert error_of(chat) == (503, "server_shutdown")
    assert responses.status == 200 and responses.json()["incomplete_details"] == {"reason": "server_shutdown"}
    *_, error, done = streamed.event_data()
    assert error["error"]["code"] == "server_shutdown" and done == "[DONE]"
    assert sorted(api.engine.aborted) == sorted(submission.request_id for submission in api.engine.submissions)


def test_a_failed_chat_completion_is_a_500_naming_the_failure():
    async def main():
        return await Api().answered("/v1/chat/completions", CHAT, ["a"], error="internal error: boom")

    peer = run(main())
    assert error_of(peer) == (500, "server_error") and "boom" in peer.json()["error"]["message"]


def test_the_body_is_read_within_the_configured_bound():
    api = Api(max_message_bytes=len(json.dumps(CHAT)))
    run(api.answered("/v1/chat/completions", CHAT, ["a"]))
    too_large = run(api.call("POST", "/v1/chat/completions", {**CHAT, "n": 1}))
    assert error_of(too_large) == (413, "request_too_large") and len(api.engine.submissions) == 1


# ------------------------------------------------------------------ a bug in a handler
def test_a_handler_that_raises_is_a_500_and_one_that_had_begun_is_reset():
    async def broken(exchange):
        raise RuntimeError("a bug")

    async def broken_midway(exchange):
        await exchange.start(200, b"text/event-stream", [])
        raise RuntimeError("a bug")

    api = Api()
    api.app.routes[("GET", "/v1/models")] = broken
    api.app.routes[("GET", "/slots")] = broken_midway
    failed = api.get("/v1/models")
    assert error_of(failed) == (500, "server_error") and failed.json()["error"]["message"] == (
        "the request failed: RuntimeError")
    midway = api.get("/slots")
    assert [message["type"] for message in midway.sent] == ["http.response.start"] and midway.resets == 1
