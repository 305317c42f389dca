"""What every part of the server shares: its settings, the engine, the tokenizer, metrics, stored conversations.

`ServerState` is what a connection's session sees of the server (localserve.server.app.LocalServer
extends it with the routes), so sessions and routes do not import each other.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from localserve.engine.engine_thread import EngineThread
from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS, SamplingDefaults
from localserve.server.metrics import ServerMetrics
from localserve.server.requests import ProtocolError


@dataclass
class ServerConfig:
    """Where to listen, who may connect, and the bounds on what they may send."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (see LocalServer.port)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed besides the server's own
    model_alias: str | None = None  # the name clients use and /v1/models lists (default: the model's)
    max_message_bytes: int = 1 << 20  # a bigger client message closes the connection with 1009
    max_connections: int = 256
    send_queue_size: int = 256  # server events waiting to be sent, per connection
    max_stored_responses: int = 1024  # conversations kept for previous_response_id (LRU)
    max_stored_chars: int = 64 << 20  # and at most this much text in all of them
    default_max_output_tokens: int = 1024  # when response.create gives no max_output_tokens
    # Sampling for what a response.create leaves out (per field); `localserve serve` takes the model's.
    sampling_defaults: SamplingDefaults = LLAMA_CPP_DEFAULTS
    monitor_interval_s: float = 0.5  # default time between /v1/monitor snapshots


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


class ConversationStore:
    """The conversations of finished responses (messages plus reply), least recently used evicted first.

    Bounded both in conversations and in characters, so long conversations cannot pile up memory.
    """

    def __init__(self, capacity: int, max_chars: int) -> None:
        self.capacity, self.max_chars = capacity, max_chars
        self.num_chars = 0
        self._conversations: OrderedDict[str, tuple[list[dict[str, str]], int]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, str]] | None:
        """A copy of the conversation ending with `response_id`'s reply, or None."""
        entry = self._conversations.get(response_id)
        if entry is None:
            return None
        self._conversations.move_to_end(response_id)
        return list(entry[0])

    def put(self, response_id: str, messages: list[dict[str, str]]) -> None:
        num_chars = sum(len(message["content"]) for message in messages)
        self._conversations[response_id] = (messages, num_chars)
        self.num_chars += num_chars
        while len(self._conversations) > 1 and (len(self._conversations) > self.capacity
                                                 or self.num_chars > self.max_chars):
            _, (_, evicted_chars) = self._conversations.popitem(last=False)
            self.num_chars -= evicted_chars

    def __len__(self) -> int:
        return len(self._conversations)


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

    def check_model(self, model: str | None) -> None:
        """Accept no model, "default", the served name or the model's own; else `model_not_found`."""
        if model not in (None, "default", self.served_name, self.model_name):
            raise ProtocolError("model_not_found", f"model {model!r} is not served here; this server serves "
                                f"{self.served_name!r} (or send 'default')", "model", status=404)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def engine_call(self, fn) -> Any:
        """Run fn(engine) on the engine thread between steps and wait for its result."""
        return await asyncio.wrap_future(self.engine_thread.call(fn))
