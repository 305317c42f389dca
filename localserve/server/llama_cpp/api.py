"""llama.cpp's own endpoints on this server's port, as its server README documents them: `POST /tokenize`,
`/detokenize`, `/apply-template` and `GET /props`.

The bodies are read by the one parser (field maps below; `/apply-template` takes a chat completion's
body and renders it as that endpoint would). Tokenizing and rendering run off the event loop. A token's
`piece` is its text, or its bytes where they are not whole UTF-8 (one byte of a character split over
several tokens), as llama.cpp gives them.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import re
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any

from localserve.engine.facts import EngineFacts
from localserve.server.config import ServerConfig
from localserve.server.generation.over_http import HttpGeneration
from localserve.server.registry.registry import ModelRegistry, model_shape
from localserve.server.registry.served_model import ServedModel
from localserve.server.request import fields
from localserve.server.request.fields import WireFormat
from localserve.server.request.validation import ProtocolError
from localserve.server.wire.http_exchange import HttpExchange
from localserve.tokenizer.tokenizer import Tokenizer

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback

TOKENIZE = WireFormat({
    "content": fields.Prompt(),
    "model": fields.Text("model", bounded=True),
    "add_special": fields.Setting(bool),
    "with_pieces": fields.Setting(bool),
    "parse_special": fields.Refused("text that spells a special token is always read as that token here (true)",
                                    fields.one_of(True), bool),
})
DETOKENIZE = WireFormat({"tokens": fields.Required(fields.Setting(list)),
                         "model": fields.Text("model", bounded=True)})


@cache
def _byte_level_bytes() -> dict[str, int]:
    """The characters byte-level BPE writes each byte as (GPT-2's table), back to the bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def token_piece(tokenizer: Tokenizer, token_id: int) -> str | list[int]:
    """The token's text, or its bytes when they are not whole UTF-8."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text
    token = tokenizer.backend.id_to_token(token_id) or ""
    if match := BYTE_TOKEN.fullmatch(token):
        return [int(match[1], 16)]
    table = _byte_level_bytes()
    if token and all(char in table for char in token):
        raw = bytes(table[char] for char in token)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return list(raw)
    return text


class LlamaCppApi:
    """The routes of llama.cpp's own endpoints, with the parts they use."""

    def __init__(self, generation: HttpGeneration, models: ModelRegistry, config: ServerConfig,
                 chat_wire: WireFormat) -> None:
        self.generation, self.models, self.config = generation, models, config
        self.chat_wire = chat_wire  # /apply-template's body: chat completions' (handed in: no other API's module here)

    def routes(self) -> dict[tuple[str, str], Callable[[HttpExchange], Awaitable[None]]]:
        return {("POST", "/tokenize"): self._tokenize, ("POST", "/detokenize"): self._detokenize,
                ("POST", "/apply-template"): self._apply_template, ("GET", "/props"): self._props}

    async def _tokenize(self, exchange: HttpExchange) -> None:
        request = await exchange.read_request(TOKENIZE, self.config)
        settings = request.settings
        async with self.models.leased(request.model) as lease:
            tokenizer: Tokenizer = lease.tokenizer  # type: ignore[assignment]  # the real one: pieces, templates
            ids = await asyncio.to_thread(tokenizer.encode, request.prompt, settings.get("add_special", False))
        if settings.get("with_pieces", False):
            tokens: list[Any] = [{"id": token_id, "piece": token_piece(tokenizer, token_id)} for token_id in ids]
        else:
            tokens = ids
        exchange.tokens = (len(ids), 0)
        await exchange.respond_json(200, {"tokens": tokens})

    async def _detokenize(self, exchange: HttpExchange) -> None:
        request = await exchange.read_request(DETOKENIZE, self.config)
        ids = request.settings["tokens"]
        if len(ids) > self.config.limits.max_input_chars:
            raise ProtocolError("array_above_max_length", f"'tokens' may hold at most "
                                f"{self.config.limits.max_input_chars} items, got {len(ids)}", "tokens")
        async with self.models.leased(request.model) as lease:
            vocab_size = lease.engine.facts.vocab_size
            for index, token_id in enumerate(ids):
                if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                    raise ProtocolError("invalid_value", f"'tokens[{index}]' must be a token id in "
                                        f"[0, {vocab_size})", f"tokens[{index}]")
            exchange.tokens = (len(ids), 0)
            text = await asyncio.to_thread(lease.tokenizer.decode, ids, False)
        await exchange.respond_json(200, {"content": text})

    async def _apply_template(self, exchange: HttpExchange) -> None:
        """The chat completion's prompt text as /v1/chat/completions renders it: its tools, tool turns and
        template switches (reasoning_effort) included."""
        request = await exchange.read_request(self.chat_wire, self.config)
        prompt = await self.generation.responses.render_prompt(request, None)
        await exchange.respond_json(200, {"prompt": prompt})

    async def _props(self, exchange: HttpExchange) -> None:
        """The default model's (llama.cpp's server serves one; a router's props name no model either)."""
        async with self.models.leased(None) as lease:
            await self._answer_props(exchange, lease.model, lease.engine.facts,
                                     lease.tokenizer)  # type: ignore[arg-type]

    async def _answer_props(self, exchange: HttpExchange, model: ServedModel, facts: EngineFacts,
                            tokenizer: Tokenizer) -> None:
        defaults = model.sampling_defaults  # a top_k that is off is llama.cpp's 0, no token limit its -1
        n_predict = self.config.default_max_output_tokens or -1
        params = {"n_predict": n_predict, "temperature": defaults.temperature,
                  "top_k": defaults.top_k or 0, "top_p": defaults.top_p, "min_p": defaults.min_p, "seed": -1,
                  "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "stop": [],
                  "max_tokens": n_predict, "stream": False, "n_probs": 0}
        await exchange.respond_json(200, {
            "default_generation_settings": {"n_ctx": model.max_model_len, "params": params},
            "total_slots": facts.max_num_seqs, "model_path": model.card.path,
            "model_alias": model.served_name, "chat_template": tokenizer.chat_template or "",
            **model_shape(model.card),
            "modalities": {"vision": model.takes_images, "audio": False},
            "build_info": f"localserve {importlib.metadata.version('localserve')}", "is_sleeping": False})
