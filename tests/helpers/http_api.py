"""An HttpApp (server/http_app.py) as an ASGI app with the parts it is handed: a real GenerationService on a
recorded engine thread (tests/helpers/engine_access.py), driven through the ASGI pair (tests/helpers/asgi.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS, SamplingDefaults
from localserve.server.config import ServerConfig
from localserve.server.embeddings.api import EmbeddingRoutes
from localserve.server.generation.conversations import ConversationStore
from localserve.server.generation.service import GenerationService
from localserve.server.http_app import HttpApp
from localserve.server.monitor.metrics import ServerMetrics
from localserve.server.registry.registry import serving_loaded
from localserve.server.wire.access import AccessPolicy, MonitorTickets
from tests.helpers.asgi import AsgiPeer, body_messages
from tests.helpers.engine_access import CountingTokenizer, RecordedEngineThread

API_KEY = "sekrit"
ORIGIN = "http://localhost:3000"
HOST = {"Host": "127.0.0.1:8080"}
KEY = {"Authorization": f"Bearer {API_KEY}"}


class Api:
    """An HttpApp and the parts it is handed."""

    def __init__(self, api_key: str | None = None, sampling_defaults: SamplingDefaults = LLAMA_CPP_DEFAULTS,
                 max_model_len: int = 200, **config: Any) -> None:
        self.engine = RecordedEngineThread(max_model_len=max_model_len)
        if "max_message_bytes" in config:  # a test that bounds the body bounds it whole, images included
            config.setdefault("max_image_body_bytes", 0)
        self.config = ServerConfig(api_key=api_key, allowed_origins=(ORIGIN,), **config)
        metrics = ServerMetrics("served")
        conversations = ConversationStore(self.config.max_stored_responses, self.config.max_stored_chars)
        self.tokenizer = CountingTokenizer()
        models = serving_loaded(self.engine, self.tokenizer, "model", alias="served",
                                sampling_defaults=sampling_defaults)
        self.responses = GenerationService(models, self.config, conversations, metrics)
        policy = AccessPolicy.build(self.config.host, 8080, (), self.config.allowed_origins, api_key)
        self.app = HttpApp(config=self.config, access_policy=policy, models=models, responses=self.responses,
                           metrics=metrics, monitor_tickets=MonitorTickets(),
                           embeddings=EmbeddingRoutes(models, self.config))

    async def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                   peer: AsgiPeer | None = None) -> AsgiPeer:
        if peer is None:
            peer = AsgiPeer(body_messages(json.dumps(body).encode()) if body is not None else body_messages(b""))
        await self.app(peer.scope(method, path, {**HOST, **(headers or {})}), peer.receive, peer.send)
        return peer

    def get(self, path: str, headers: dict[str, str] | None = None) -> AsgiPeer:
        return run(self.call("GET", path, headers=headers))

    async def answered(self, path: str, body: Any, texts: list[str], error: str | None = None,
                       peer: AsgiPeer | None = None) -> AsgiPeer:
        """POST `body` to `path`; the engine ends the request with `texts` (one token per character)."""
        submitted = len(self.engine.submissions)
        call = asyncio.create_task(self.call("POST", path, body, peer=peer))
        await until(lambda: len(self.engine.submissions) > submitted or call.done())
        if not call.done():
            submission = self.engine.submissions[-1]
            for count, text in enumerate(texts, start=1):
                self.engine.answer(submission, [text], count, finished=count == len(texts) and error is None,
                                   reason="stop")
                await asyncio.sleep(0)
            if error is not None:
                self.engine.answer(submission, [], len(texts), finished=True, error=error)
        return await call


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


def response(peer: AsgiPeer) -> tuple[int, dict[str, str], bytes]:
    """What the app answered `peer`: status, headers (lower-case names), body."""
    start = next(message for message in peer.sent if message["type"] == "http.response.start")
    body = b"".join(message.get("body", b"") for message in peer.sent if message["type"] == "http.response.body")
    headers = {name.decode(): value.decode() for name, value in start["headers"]}
    return start["status"], headers, body
