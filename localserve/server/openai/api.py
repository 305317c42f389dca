"""OpenAI's generation endpoints over HTTP: `POST /v1/chat/completions`, `/v1/completions` and `/v1/responses`,
each read through its field map into the one request model and run by the shared HTTP runner, answered whole or
as server-sent events in its shape (`CompletionView`, `ResponsesEvents`). The `/v1/responses` websocket is
server/openai/responses_socket.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from localserve.server.config import ServerConfig
from localserve.server.generation.over_http import HttpGeneration
from localserve.server.openai.completion_events import CompletionView
from localserve.server.openai.completions_format import CHAT_COMPLETIONS, COMPLETIONS
from localserve.server.openai.responses_events import ResponsesEvents
from localserve.server.openai.responses_format import RESPONSES_HTTP
from localserve.server.wire.http_exchange import HttpExchange


class OpenAiApi:
    """The routes of OpenAI's generation endpoints."""

    def __init__(self, generation: HttpGeneration, config: ServerConfig) -> None:
        self.generation, self.config = generation, config

    def routes(self) -> dict[tuple[str, str], Callable[[HttpExchange], Awaitable[None]]]:
        return {("POST", "/v1/chat/completions"): self._chat_completions,
                ("POST", "/v1/completions"): self._completions, ("POST", "/v1/responses"): self._responses}

    async def _chat_completions(self, exchange: HttpExchange) -> None:
        request = await exchange.read_request(CHAT_COMPLETIONS, self.config)
        await self.generation.run(exchange, request, lambda stream: CompletionView(
            stream, chat=True, include_usage=request.include_usage))

    async def _completions(self, exchange: HttpExchange) -> None:
        request = await exchange.read_request(COMPLETIONS, self.config)
        await self.generation.run(exchange, request, lambda stream: CompletionView(
            stream, chat=False, include_usage=request.include_usage))

    async def _responses(self, exchange: HttpExchange) -> None:
        await self.generation.run(exchange, await exchange.read_request(RESPONSES_HTTP, self.config), ResponsesEvents)
