"""What every part of the server shares: its settings, the engine, the tokenizer, metrics, stored conversations.

`ServerState` is what a connection's session sees of the server (localserve.server.app.LocalServer
extends it with the routes), so sessions and routes do not import each other.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from localserve.engine.engine_thread import EngineThread
from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS, SamplingDefaults
from localserve.server.conversations import ConversationStore
from localserve.server.metrics import ServerMetrics
from localserve.server.requests import RequestLimits
from localserve.server.responses import ResponseService
from localserve.server.validation import ProtocolError, shown

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
    model_alias: str | None = None  # the name clients use and /v1/models lists (default: the model's)
    max_message_bytes: int = 1 << 20  # a bigger client message closes the connection with 1009
    max_connections: int = 256
    max_lanes: int = 16  # stream_id lanes with a response running or queued, per connection
    max_queued_requests: int = 16  # response.create events waiting for their lane, per connection
    send_queue_size: int = 256  # error events waiting to be sent, per connection; a full queue cuts it
    send_timeout_s: float = 30.0  # a client that takes no frame (or answers no ping) for this long is cut
    keepalive_interval_s: float = 20.0  # between pings, so a client that stops reading is cut even when idle
    write_limit_bytes: int = 1 << 16  # bytes buffered for a client before sending waits for it to read
    shutdown_timeout_s: float = 5.0  # SIGINT/SIGTERM: time to tell every client before closing anyway
    max_stored_responses: int = 1024  # conversations kept for previous_response_id (LRU)
    max_stored_chars: int = 64 << 20  # and at most this much text in all of them
    default_max_output_tokens: int = 1024  # when response.create gives no max_output_tokens
    # Sampling for what a response.create leaves out (per field); `localserve serve` takes the model's.
    sampling_defaults: SamplingDefaults = LLAMA_CPP_DEFAULTS
    monitor_interval_s: float = 0.5  # default time between /v1/monitor snapshots
    limits: RequestLimits = field(default_factory=RequestLimits)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_safety(config: ServerConfig) -> None:
    """Refuse to listen beyond this machine without an API key (raises ValueError)."""
    if not is_loopback(config.host) and not config.api_key:
        raise ValueError(f"refusing to listen on {config.host}: anyone who can reach it could use the "
                         "server; pass --api-key KEY (clients send 'Authorization: Bearer KEY'), or bind "
                         "127.0.0.1")


@dataclass
class ServerState:
    """The server's shared state and the helpers sessions use."""

    engine_thread: EngineThread
    tokenizer: Any  # localserve.tokenizer.tokenizer.Tokenizer: encode_chat, decode
    model_name: str
    config: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        check_bind_safety(self.config)
        self.served_name = self.config.model_alias or self.model_name
        self.metrics = ServerMetrics(self.served_name)
        self.conversations = ConversationStore(self.config.max_stored_responses, self.config.max_stored_chars)
        self.responses = ResponseService(self)
        self.num_connections = 0

    def check_model(self, model: str | None) -> None:
        """Accept no model, "default", the served name or the model's own; else `model_not_found`."""
        if model not in (None, "default", self.served_name, self.model_name):
            raise ProtocolError("model_not_found", f"model {shown(model, 80)} is not served here; this server "
                                f"serves {self.served_name!r} (or send 'default')", "model", status=404)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def engine_call(self, fn) -> Any:
        """Run fn(engine) on the engine thread between steps and wait (a bounded time) for its result."""
        return await asyncio.wait_for(asyncio.wrap_future(self.engine_thread.call(fn)), ENGINE_CALL_TIMEOUT_S)
