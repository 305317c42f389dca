"""Ollama's API on this server's port: `GET /api/version`, `/api/tags`, `/api/ps`, `POST /api/show`,
`/api/chat` and `/api/generate`, as Ollama's docs/api.md documents them (`/api/embed` belongs to the
embeddings work).

Generation goes through the one request model (server/ollama/format.py's field maps) and the shared
HTTP runner; the model endpoints list every model served (server/registry/registry.py) and describe a loaded one
from its `ModelCard` (`/api/show` of a model not loaded reads its files: server/registry/description.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from localserve.loading.model_card import ModelCard
from localserve.loading.model_folder import ModelEntry
from localserve.server.config import ServerConfig
from localserve.server.generation.over_http import HttpGeneration
from localserve.server.ollama.events import OllamaView, load_answer, wire_time
from localserve.server.ollama.format import OLLAMA_CHAT, OLLAMA_GENERATE
from localserve.server.registry.registry import ListedModel, ModelLease, ModelRegistry, ModelStatus
from localserve.server.request import fields
from localserve.server.request.fields import WireFormat
from localserve.server.request.validation import ProtocolError
from localserve.server.wire.http_exchange import HttpExchange

# The Ollama release whose API this server serves: 0.13.4 added OpenAI's /v1/responses, the newest of the APIs
# served here that Ollama's clients check the version for (Codex's --oss needs it, and falls back or stops below
# it); /api/ps, /api/embed with `dimensions`, `format` schemas, `think` with levels and `tool_name` came before.
# Fields of later releases this server does not honour (the chat's `logprobs`) are refused by name.
OLLAMA_API_VERSION = "0.13.4"
NEVER_EXPIRES = "9999-12-31T23:59:59Z"  # /api/ps: the model stays loaded while the server runs
SHOW = WireFormat({"model": fields.Text("model", bounded=True, preferred=True),
                   "name": fields.Text("model", bounded=True),  # Ollama's older spelling (litellm's ollama_chat/)
                   "verbose": fields.Ignored("model_info holds no token lists, verbose or not", bool)})


class OllamaApi:
    """The routes of Ollama's API, with the parts they use."""

    def __init__(self, generation: HttpGeneration, models: ModelRegistry, config: ServerConfig) -> None:
        self.generation, self.models, self.config = generation, models, config

    def routes(self) -> dict[tuple[str, str], Callable[[HttpExchange], Awaitable[None]]]:
        return {("GET", "/api/version"): self._version, ("GET", "/api/tags"): self._tags,
                ("GET", "/api/ps"): self._ps, ("POST", "/api/show"): self._show,
                ("POST", "/api/chat"): self._chat, ("POST", "/api/generate"): self._generate}

    async def _version(self, exchange: HttpExchange) -> None:
        await exchange.respond_json(200, {"version": OLLAMA_API_VERSION})

    async def _tags(self, exchange: HttpExchange) -> None:
        """Every model served, loaded or not (a loaded one described by its card)."""
        cards = {info.name: served.card for info, served, _ in self.models.loaded()}
        await exchange.respond_json(200, {"models": [model_entry(info, cards.get(info.name))
                                                     for info in self.models.models()]})

    async def _ps(self, exchange: HttpExchange) -> None:
        """The models loaded now: their weights and KV pool in memory."""
        running = []
        for info, served, engine in self.models.loaded():
            size = served.card.size_bytes + engine.facts.kv_cache_bytes
            expires_in = self.models.expires_in(info.name)
            expires_at = NEVER_EXPIRES if expires_in is None else wire_time(time.time() + expires_in)
            running.append({**model_entry(info, served.card), "size": size, "expires_at": expires_at,
                            "size_vram": size, "context_length": served.max_model_len})
        await exchange.respond_json(200, {"models": running})

    async def _show(self, exchange: HttpExchange) -> None:
        """A model's details, template and capabilities; one not loaded is described from its files (nothing
        is loaded or unloaded for it)."""
        request = await exchange.read_request(SHOW, self.config)
        if request.model is None:
            raise ProtocolError("missing_required_parameter", "'model' (or its older spelling 'name') is required",
                                "model")
        shown = await self.models.shown(self._find(request.model))
        model = shown.model
        card, defaults = model.card, model.sampling_defaults
        top_k = [f"top_k {defaults.top_k}"] if defaults.top_k is not None else []  # None: off, so not set
        parameters = [f"temperature {defaults.temperature:g}", *top_k, f"top_p {defaults.top_p:g}",
                      f"min_p {defaults.min_p:g}", f"num_ctx {model.max_model_len}"]
        await exchange.respond_json(200, {
            "modelfile": "", "parameters": "\n".join(parameters), "template": shown.chat_template or "",
            "details": card_details(card), "model_info": dict(card.model_info),
            "capabilities": model.capabilities, "modified_at": card.modified_at})

    async def _chat(self, exchange: HttpExchange) -> None:
        await self._run(exchange, OLLAMA_CHAT, chat=True)

    async def _generate(self, exchange: HttpExchange) -> None:
        await self._run(exchange, OLLAMA_GENERATE, chat=False)

    async def _run(self, exchange: HttpExchange, wire: WireFormat, chat: bool) -> None:
        request = await exchange.read_request(wire, self.config)
        entry = self._find(request.model)
        if request.keep_alive_s is not None:  # from now on, for this model (as in Ollama)
            self.models.keep_alive(entry, request.keep_alive_s)
        if not request.has_input:  # Ollama's way of loading a model, and with keep_alive 0 of unloading it
            unload = request.keep_alive_s == 0
            if unload and self.models.status(entry) is not ModelStatus.LOADED:  # nothing to load for it
                return await exchange.respond_json(200, load_answer(request.model or entry.id, chat, "unload"))
            async with self._leased(request.model) as lease:  # unloaded once this lease is over
                return await exchange.respond_json(200, load_answer(lease.model.served_name, chat,
                                                                    "unload" if unload else "load"))
        await self.generation.run(exchange, request, lambda stream: OllamaView(stream, chat), entry)

    def _find(self, name: str | None) -> ModelEntry:
        """The model `name` names, in Ollama's words for another name."""
        try:
            return self.models.find(name)
        except ProtocolError as error:
            raise ProtocolError(error.code, f"model {name!r} not found: {error.message}", error.param,
                                status=error.status) from None

    @contextlib.asynccontextmanager
    async def _leased(self, name: str | None) -> AsyncIterator[ModelLease]:
        lease = await self.models.acquire(self._find(name))
        try:
            yield lease
        finally:
            lease.release()


def model_entry(info: ListedModel, card: ModelCard | None) -> dict[str, Any]:
    """A model of /api/tags and /api/ps: from its card once loaded, else from its files' names."""
    if card is not None:
        details, modified_at, size, digest = card_details(card), card.modified_at, card.size_bytes, card.digest
    else:
        family = info.family or ""
        details = {"parent_model": "", "format": info.format or "", "family": family,
                   "families": [family] if family else None, "parameter_size": info.parameter_size or "",
                   "quantization_level": info.quantization or ""}
        modified_at = datetime.fromtimestamp(info.modified_s or 0.0, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        size = info.size_bytes
        digest = hashlib.sha256(f"{info.name} {size} {info.modified_s}".encode()).hexdigest()
    return {"name": info.name, "model": info.name, "modified_at": modified_at, "size": size, "digest": digest,
            "details": details}


def card_details(card: ModelCard) -> dict[str, Any]:
    """Ollama's `details` of a loaded model."""
    return {"parent_model": "", "format": card.format, "family": card.family,
            "families": [card.family] if card.family else None, "parameter_size": card.parameter_size,
            "quantization_level": card.quantization}
