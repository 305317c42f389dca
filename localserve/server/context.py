"""What the server's parts share: its settings, the engine thread as the server sees it, a served model.

Each part of the server (the HTTP API, a websocket session, the response service, the monitor) is
handed the pieces of these it uses; none of them sees the server object or the engine itself.
`EngineAccess` is all the server reads of an engine: its fixed facts, submitting and aborting, and
statistics, snapshots and events read on the engine thread between steps. Each loaded model has its
own engine thread (server/models.py lends them out, one request at a time).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from localserve.engine.embedding_params import EmbeddingParams
from localserve.engine.events import EngineEvent
from localserve.engine.facts import EngineFacts
from localserve.engine.outputs import RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.snapshot import EngineSnapshot, EngineStats
from localserve.loading.model_card import ModelCard
from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.connection_phases import PhaseBounds
from localserve.server.request_model import RequestLimits
from localserve.server.validation import ProtocolError
from localserve.tokenizer.chat_format import ChatFormat

T = TypeVar("T")
ENGINE_CALL_TIMEOUT_S = 30.0  # a snapshot or statistics call on the engine thread never takes longer
CLOSE_TIMEOUT_S = 2.0  # a closing handshake the client does not answer is cut after this long


async def close_within(connection: Any, code: int, reason: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """Close a websocket, but never wait longer than `timeout_s`: a client that reads nothing cannot
    take the close frame (websockets' own close waits for the write buffer to drain), so it is reset."""
    try:
        await asyncio.wait_for(connection.close(code, reason), timeout_s)
    except asyncio.TimeoutError:
        connection.transport.abort()


@dataclass
class ServerConfig:
    """Where to listen, who may connect, and the bounds on what they may send."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (see LocalServer.port)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed besides the server's own
    allowed_hosts: tuple[str, ...] = ()  # Host header names allowed besides loopback names and --host
    max_message_bytes: int = 1 << 20  # a bigger client message closes the connection with 1009
    # Connections with a request (HTTP, answered or idle between two; websockets that have spoken; monitors);
    # a whole request beyond them is a 429. Connections still sending theirs are capped apart (see
    # server/connection_phases.py): one more closes the oldest of them.
    max_connections: int = 256
    max_unfinished_connections: int | None = None  # None: as many as max_connections (a burst of clients fits)
    phase_bounds: PhaseBounds = field(default_factory=PhaseBounds)  # the time each phase of a request may take
    max_running_responses: int = 1024  # responses submitted and not ended, every transport; more: 429
    http_body_timeout_s: float = 30.0  # an HTTP request body must arrive whole within this long
    max_lanes: int = 16  # stream_id lanes with a response running or queued, per connection
    max_queued_requests: int = 16  # response.create events waiting for their lane, per connection
    send_queue_size: int = 256  # error events waiting to be sent, per connection; a full queue cuts it
    send_timeout_s: float = 30.0  # a client that takes no frame (or answers no ping) for this long is cut
    keepalive_interval_s: float = 20.0  # between pings, so a client that stops reading is cut even when idle
    write_limit_bytes: int = 1 << 16  # bytes buffered for a client before sending waits for it to read
    shutdown_timeout_s: float = 5.0  # SIGINT/SIGTERM: time to tell every client before closing anyway
    max_stored_responses: int = 1024  # conversations kept for previous_response_id (LRU)
    max_stored_chars: int = 64 << 20  # and at most this much text in all of them
    # the token limit of a request that sets none; None: the context alone bounds it (as OpenAI's APIs do)
    default_max_output_tokens: int | None = None
    monitor_interval_s: float = 0.5  # default time between /v1/monitor snapshots
    web_ui: bool = True  # the web page at / (server/web_ui.py); False: / is a 404 (--no-webui)
    limits: RequestLimits = field(default_factory=RequestLimits)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    # Not ::ffff:127.0.0.1, which Python 3.13 calls loopback and older ones do not: the answer must not
    # depend on the Python version (and asyncio binds IPv6 sockets IPv6-only, where it is no address).
    return address.is_loopback and not (address.version == 6 and address.ipv4_mapped is not None)


def check_bind_safety(config: ServerConfig) -> None:
    """Refuse to listen beyond this machine without an API key (raises ValueError)."""
    if not is_loopback(config.host) and not config.api_key:
        raise ValueError(f"refusing to listen on {config.host}: anyone who can reach it could use the "
                         "server; pass --api-key KEY (clients send 'Authorization: Bearer KEY'), or bind "
                         "127.0.0.1")


class EngineAccess(Protocol):
    """What the server uses of the engine thread (localserve.engine.engine_thread.EngineThread)."""

    facts: EngineFacts

    @property
    def last_event_seq(self) -> int:
        """The number of the engine's latest event."""

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | EmbeddingParams,
               on_output: Callable[[RequestOutput], None], request_id: str | None = None) -> str:
        """Queue a request (an embedding request with EmbeddingParams); raises ValueError at once if it can
        never run."""

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step."""

    def stats(self) -> Future[EngineStats]:
        """The engine's gauges and counters, read between two steps."""

    def snapshot_and_events(self, after_seq: int) -> Future[tuple[EngineSnapshot, list[EngineEvent], int]]:
        """A snapshot, the events after `after_seq` and how many of those are gone, read together."""


def on_event_loop(loop: asyncio.AbstractEventLoop, handle: Callable[[RequestOutput], None]
                  ) -> Callable[[RequestOutput], None]:
    """An engine thread's output callback that runs `handle(output)` on `loop`. Once the loop is closed
    (the server has stopped; the engine thread stops after it) an output has nobody to go to and is
    dropped: a step under way when the server closed, a stopped response's final output."""
    def post(output: RequestOutput) -> None:
        try:
            loop.call_soon_threadsafe(handle, output)
        except RuntimeError:  # closed, checked under the loop's own rules (no race with is_closed())
            if not loop.is_closed():
                raise
    return post


async def engine_result(future: Future[T]) -> T:
    """The result of a read the engine thread makes between two steps, waited for a bounded time."""
    return await asyncio.wait_for(asyncio.wrap_future(future), ENGINE_CALL_TIMEOUT_S)


class ChatTokenizer(Protocol):
    """What the server uses of a model's tokenizer (localserve.tokenizer.tokenizer.Tokenizer)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> str: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ServedModel:
    """A loaded model as its requests see it: the name it is served under, its context, its sampling defaults,
    its chat format (how it calls tools and reasons; None: its tokenizer has no chat template), its files
    (`card`, for Ollama's and llama.cpp's model endpoints) and whether it is an embedding model."""

    served_name: str  # its id in /v1/models (--alias for the default model)
    max_model_len: int
    sampling_defaults: SamplingDefaults  # what a request leaves out (the model's generation_config.json, ...)
    is_embedding: bool = False  # an embedding model (EngineFacts.embedding): /v1/embeddings, no text generation
    chat_format: ChatFormat | None = None
    card: ModelCard = ModelCard()

    def check_generates(self) -> None:
        """Refuse text generation from an embedding model (400 naming `model`)."""
        if self.is_embedding:
            raise ProtocolError("model_not_generative", f"model {self.served_name!r} is an embedding model: it "
                                "computes embeddings (POST /v1/embeddings, /api/embed), not text", "model")

    @property
    def capabilities(self) -> list[str]:
        """What the model does, in Ollama's words (`/api/show`): "embedding" for an embedding model; else
        "completion", "tools" where it has a chat format (every format can be offered tools:
        tokenizer/chat_format.py) and "thinking" where that format reasons."""
        if self.is_embedding:
            return ["embedding"]
        found = ["completion"]
        if self.chat_format is not None:
            found.append("tools")
            if self.chat_format.reasoning is not None:
                found.append("thinking")
        return found

    def chat_fields(self) -> dict[str, Any]:
        """`/v1/models`' fields of the chat format: the tool-call format's name and the reasoning format."""
        chat_format = self.chat_format
        reasoning = chat_format.reasoning if chat_format is not None else None
        return {"tool_call_format": chat_format.tool_format.name if chat_format is not None else None,
                "reasoning": None if reasoning is None else {"format": reasoning.name,
                                                             "can_disable": reasoning.can_disable}}
