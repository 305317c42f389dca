"""Anthropic's Messages API on this server's port: `POST /v1/messages` and
`POST /v1/messages/count_tokens`, through the one request model (server/anthropic/format.py) and the
shared HTTP runner. The `x-api-key` header carries the key as `Authorization: Bearer` does
(server/wire/access.py); `anthropic-version` and `anthropic-beta` are accepted and change nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from localserve.server.anthropic.events import AnthropicView
from localserve.server.anthropic.format import COUNT_TOKENS, MESSAGES
from localserve.server.config import ServerConfig
from localserve.server.generation.over_http import HttpGeneration
from localserve.server.wire.http_exchange import HttpExchange


class AnthropicApi:
    """The routes of Anthropic's Messages API."""

    def __init__(self, generation: HttpGeneration, config: ServerConfig) -> None:
        self.generation, self.config = generation, config

    def routes(self) -> dict[tuple[str, str], Callable[[HttpExchange], Awaitable[None]]]:
        return {("POST", "/v1/messages"): self._messages, ("POST", "/v1/messages/count_tokens"): self._count_tokens}

    async def _messages(self, exchange: HttpExchange) -> None:
        request = await exchange.read_request(MESSAGES, self.config)
        await self.generation.run(exchange, request, AnthropicView)

    async def _count_tokens(self, exchange: HttpExchange) -> None:
        request = await exchange.read_request(COUNT_TOKENS, self.config)
        count = await self.generation.responses.count_prompt_tokens(request, None)
        exchange.model, exchange.tokens = request.model, (count, 0)
        await exchange.respond_json(200, {"input_tokens": count})
