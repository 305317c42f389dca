"""Ollama's API on this server's port: `GET /api/version`, `/api/tags`, `/api/ps`, `POST /api/show`,
`/api/chat` and `/api/generate`, as Ollama's docs/api.md documents them (`/api/embed` belongs to the
embeddings work).

Generation goes through the one request model (server/ollama_format.py's field maps) and the shared
HTTP runner; the model endpoints describe the one served model from its `ModelCard`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from localserve.engine.facts import EngineFacts
from localserve.server import request_fields as fields
from localserve.server.context import ServedModel
from localserve.server.http_exchange import HttpExchange
from localserve.server.http_generation import HttpGeneration
from localserve.server.ollama_events import OllamaView, load_answer
from localserve.server.ollama_format import OLLAMA_CHAT, OLLAMA_GENERATE
from localserve.server.request_fields import WireFormat
from localserve.server.validation import ProtocolError
from localserve.tokenizer.chat_format import ChatFormat
from localserve.tokenizer.tokenizer import Tokenizer

# The Ollama release whose documented API this follows (/api/ps, /api/embed, `format` schemas, `think`).
OLLAMA_API_VERSION = "0.9.0"
NEVER_EXPIRES = "9999-12-31T23:59:59Z"  # /api/ps: the model stays loaded while the server runs
SHOW = WireFormat({"model": fields.Required(fields.Text("model", bounded=True)),
                   "name": fields.Text("model", bounded=True),  # Ollama's older spelling
                   "verbose": fields.Ignored("model_info holds no token lists, verbose or not", bool)})


def capabilities(chat_format: ChatFormat | None) -> list[str]:
    """Ollama's `capabilities` of the served model: completion; tools where it has a chat format (every format
    can be offered tools: tokenizer/chat_format.py); thinking where that format reasons."""
    found = ["completion"]
    if chat_format is not None:
        found.append("tools")
        if chat_format.reasoning is not None:
            found.append("thinking")
    return found


class OllamaApi:
    """The routes of Ollama's API, with the parts they use."""

    def __init__(self, generation: HttpGeneration, model: ServedModel, facts: EngineFacts,
                 tokenizer: Tokenizer) -> None:
        self.generation, self.model, self.facts, self.tokenizer = generation, model, facts, tokenizer

    def routes(self) -> dict[tuple[str, str], Callable[[HttpExchange], Awaitable[None]]]:
        return {("GET", "/api/version"): self._version, ("GET", "/api/tags"): self._tags,
                ("GET", "/api/ps"): self._ps, ("POST", "/api/show"): self._show,
                ("POST", "/api/chat"): self._chat, ("POST", "/api/generate"): self._generate}

    async def _version(self, exchange: HttpExchange) -> None:
        await exchange.respond_json(200, {"version": OLLAMA_API_VERSION})

    async def _tags(self, exchange: HttpExchange) -> None:
        await exchange.respond_json(200, {"models": [self._model_entry()]})

    async def _ps(self, exchange: HttpExchange) -> None:
        size = self.model.card.size_bytes + self.facts.kv_cache_bytes  # the weights and the KV pool
        entry = {**self._model_entry(), "size": size, "expires_at": NEVER_EXPIRES, "size_vram": size,
                 "context_length": self.model.max_model_len}
        await exchange.respond_json(200, {"models": [entry]})

    async def _show(self, exchange: HttpExchange) -> None:
        request = await self.generation.read(exchange, SHOW)
        self._check_model(request.model)
        card, defaults = self.model.card, self.model.sampling_defaults
        top_k = [f"top_k {defaults.top_k}"] if defaults.top_k is not None else []  # None: off, so not set
        parameters = [f"temperature {defaults.temperature:g}", *top_k, f"top_p {defaults.top_p:g}",
                      f"min_p {defaults.min_p:g}", f"num_ctx {self.model.max_model_len}"]
        await exchange.respond_json(200, {
            "modelfile": "", "parameters": "\n".join(parameters), "template": self.tokenizer.chat_template or "",
            "details": self._details(), "model_info": dict(card.model_info),
            "capabilities": capabilities(self.model.chat_format), "modified_at": card.modified_at})

    async def _chat(self, exchange: HttpExchange) -> None:
        await self._run(exchange, OLLAMA_CHAT, chat=True)

    async def _generate(self, exchange: HttpExchange) -> None:
        await self._run(exchange, OLLAMA_GENERATE, chat=False)

    async def _run(self, exchange: HttpExchange, wire: WireFormat, chat: bool) -> None:
        request = await self.generation.read(exchange, wire)
        self._check_model(request.model)
        if not request.has_input:  # Ollama's way of loading the model: it is loaded
            return await exchange.respond_json(200, load_answer(self.model.served_name, chat))
        await self.generation.run(exchange, request, lambda stream: OllamaView(stream, chat))

    def _check_model(self, name: str | None) -> None:
        """The served model's check, in Ollama's words for another name."""
        try:
            self.model.check(name)
        except ProtocolError as error:
            raise ProtocolError(error.code, f"model {name!r} not found: {error.message}", error.param,
                                status=error.status) from None

    def _model_entry(self) -> dict[str, Any]:
        card, name = self.model.card, self.model.served_name
        return {"name": name, "model": name, "modified_at": card.modified_at, "size": card.size_bytes,
                "digest": card.digest, "details": self._details()}

    def _details(self) -> dict[str, Any]:
        card = self.model.card
        return {"parent_model": "", "format": card.format, "family": card.family,
                "families": [card.family] if card.family else None, "parameter_size": card.parameter_size,
                "quantization_level": card.quantization}
