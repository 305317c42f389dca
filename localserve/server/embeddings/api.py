"""`POST /v1/embeddings` (OpenAI's shape) and `POST /api/embed` (Ollama's): each input becomes one
embedding request of the engine (a prompt-only request: prefilled in chunks beside the generation
requests, pooled, its blocks freed), all of one call submitted at once so they share steps.

Bodies are checked by server/embeddings/request.py; here the inputs are tokenized off the event loop,
each is checked against the context (`input[i]`; Ollama's `truncate`, on by default, cuts it instead),
and the vectors come back as floats or base64 (little-endian float32). A generation model answers 400
naming `model`. A client that goes away has its unfinished inputs aborted at once.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from localserve.engine.embedding_params import EmbeddingParams
from localserve.engine.outputs import RequestOutput
from localserve.server.config import ServerConfig
from localserve.server.embeddings.request import (
    EmbeddingRequest,
    check_token_ids,
    parse_ollama_embed,
    parse_openai_embeddings,
)
from localserve.server.registry.engine_access import on_event_loop
from localserve.server.registry.registry import ModelLease, ModelRegistry
from localserve.server.request.validation import ProtocolError
from localserve.server.wire.http_exchange import CLOSING_ERRORS, HttpExchange

Route = Callable[[HttpExchange], Awaitable[None]]


@dataclass(frozen=True)
class Embeddings:
    """The vectors of one call, in input order, and the tokens they were computed from."""

    vectors: list[list[float]]
    num_prompt_tokens: int
    model: str  # the name the model is served under


class EmbeddingRoutes:
    """The two routes, over the served models (each call takes a lease on the model it names) and the
    server's bounds."""

    def __init__(self, models: ModelRegistry, config: ServerConfig) -> None:
        self.models, self.config = models, config
        self.num_running = 0  # calls between submission and their last vector

    def routes(self) -> dict[tuple[str, str], Route]:
        return {("POST", "/v1/embeddings"): self._openai, ("POST", "/api/embed"): self._ollama}

    async def _openai(self, exchange: HttpExchange) -> None:
        body = await exchange.read_json(self.config.max_message_bytes, self.config.http_body_timeout_s)
        request = parse_openai_embeddings(body, self.config.limits)
        result = await self.embed(request, exchange)
        if result is None:
            return
        data = [{"object": "embedding", "index": index, "embedding": _encoded(vector, request.encoding_format)}
                for index, vector in enumerate(result.vectors)]
        await exchange.respond_json(200, {"object": "list", "data": data, "model": result.model,
                                          "usage": {"prompt_tokens": result.num_prompt_tokens,
                                                    "total_tokens": result.num_prompt_tokens}})

    async def _ollama(self, exchange: HttpExchange) -> None:
        """Ollama's shape, errors included: `{"error": message}` with the status."""
        start = time.monotonic_ns()
        try:
            body = await exchange.read_json(self.config.max_message_bytes, self.config.http_body_timeout_s)
            request = parse_ollama_embed(body, self.config.limits)
            result = await self.embed(request, exchange)
        except ProtocolError as error:
            return await exchange.respond_json(error.status, {"error": error.message},
                                               close=error.code in CLOSING_ERRORS)
        if result is None:
            return
        await exchange.respond_json(200, {"model": result.model, "embeddings": result.vectors,
                                          "total_duration": time.monotonic_ns() - start, "load_duration": 0,
                                          "prompt_eval_count": result.num_prompt_tokens})

    async def embed(self, request: EmbeddingRequest, exchange: HttpExchange) -> Embeddings | None:
        """The request's vectors; None when the client went away first (its inputs are aborted)."""
        entry = self.models.find(request.model)
        if request.keep_alive_s is not None:
            self.models.keep_alive(entry, request.keep_alive_s)
        if self.num_running >= self.config.max_running_responses:
            raise ProtocolError("server_busy", f"the server is running its limit of "
                                f"{self.config.max_running_responses} requests; retry later",
                                error_type="rate_limit_error", status=429)
        self.num_running += 1
        try:
            lease = await self.models.acquire(entry)
            try:
                self._check_model(request, lease)
                token_lists = await self._tokenize(request, lease)
                return await self._run(token_lists, EmbeddingParams(request.dimensions), lease, exchange)
            finally:
                lease.release()
        finally:
            self.num_running -= 1

    @staticmethod
    def _check_model(request: EmbeddingRequest, lease: ModelLease) -> None:
        name = lease.model.served_name
        embedding = lease.engine.facts.embedding
        if embedding is None:
            raise ProtocolError("model_not_embedding", f"model {name!r} is a text generation "
                                "model: it has no pooling config (sentence-transformers' modules.json, a GGUF's "
                                "pooling_type), so it computes no embeddings; serve an embedding model such as "
                                "Qwen3-Embedding", "model")
        if request.dimensions is not None:
            if not embedding.truncatable:
                raise ProtocolError("unsupported_parameter", f"'dimensions' is not supported by model "
                                    f"{name!r}: its embeddings are not trained for Matryoshka "
                                    "truncation", "dimensions")
            if request.dimensions > embedding.dimensions:
                raise ProtocolError("integer_above_max_value", f"'dimensions' must be <= {embedding.dimensions} "
                                    f"(the model's embedding size), got {request.dimensions}", "dimensions")
        check_token_ids(request, lease.engine.facts.vocab_size)

    @staticmethod
    async def _tokenize(request: EmbeddingRequest, lease: ModelLease) -> list[list[int]]:
        """Each input's token ids, checked against the context (cut to it with `truncate`)."""
        encode = lease.tokenizer.encode
        texts = [(index, item) for index, item in enumerate(request.inputs) if isinstance(item, str)]
        encoded = await asyncio.to_thread(lambda: [encode(text) for _, text in texts]) if texts else []
        token_lists = list(request.inputs)
        for (index, _), token_ids in zip(texts, encoded):
            token_lists[index] = token_ids
        max_model_len = lease.model.max_model_len
        for index, token_ids in enumerate(token_lists):
            param = f"input[{index}]"
            if not token_ids:
                raise ProtocolError("invalid_prompt", f"'{param}' tokenizes to no tokens", param)
            if len(token_ids) > max_model_len:
                if not request.truncate:
                    raise ProtocolError("context_length_exceeded", f"'{param}' is {len(token_ids)} tokens; the "
                                        f"context holds {max_model_len}", param)
                token_lists[index] = token_ids[:max_model_len]
        return token_lists  # type: ignore[return-value]

    @staticmethod
    async def _run(token_lists: Sequence[list[int]], params: EmbeddingParams, lease: ModelLease,
                   exchange: HttpExchange) -> Embeddings | None:
        loop = asyncio.get_running_loop()
        pending: dict[str, asyncio.Future[RequestOutput]] = {}
        futures: list[asyncio.Future[RequestOutput]] = []
        watcher = asyncio.create_task(exchange.wait_disconnect())
        try:
            for index, token_ids in enumerate(token_lists):
                future: asyncio.Future[RequestOutput] = loop.create_future()
                futures.append(future)
                try:
                    request_id = lease.engine.submit(token_ids, params, _settle_from_engine_thread(loop, future))
                except ValueError as exc:  # bounds are checked above: what is left is the pool's size
                    raise ProtocolError("invalid_request", f"input[{index}]: {exc}", f"input[{index}]") from None
                pending[request_id] = future
            gathered = asyncio.gather(*futures)
            await asyncio.wait([gathered, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not gathered.done():
                gathered.cancel()
                return None  # the client went away: the finally aborts what is left
            outputs = gathered.result()
        finally:
            watcher.cancel()
            for request_id, future in pending.items():
                if not future.done():
                    lease.engine.abort(request_id)
        failed = next((output for output in outputs if output.error is not None), None)
        if failed is not None:
            raise ProtocolError("server_error", f"the request failed: {failed.error}", error_type="server_error",
                                status=500)
        return Embeddings([output.embedding for output in outputs], sum(len(ids) for ids in token_lists),
                          lease.model.served_name)


def _settle_from_engine_thread(loop: asyncio.AbstractEventLoop,
                               future: asyncio.Future[RequestOutput]) -> Callable[[RequestOutput], None]:
    """The engine thread's callback: the final output settles `future` on the event loop."""
    def settle(output: RequestOutput) -> None:  # on the loop
        if not future.done():
            future.set_result(output)

    post = on_event_loop(loop, settle)

    def on_output(output: RequestOutput) -> None:  # on the engine thread
        if output.finished:
            post(output)
    return on_output


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector

