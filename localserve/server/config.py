"""The server's settings: where to listen, who may connect, and the bounds on what they may send.

Each part of the server (the HTTP app, a websocket session, the generation service, the monitor) is
handed the pieces it uses; none of them sees the server object or the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localserve.server.request.generation_request import RequestLimits
from localserve.server.wire.connection_phases import PhaseBounds

# A request up to this many bytes is parsed on the event loop; a larger one (images to decode) on a worker thread.
INLINE_PARSE_BYTES = 256 << 10


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
    # server/wire/connection_phases.py): one more closes the oldest of them.
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
    # the room a generation request's body has for its images beyond max_message_bytes; None: the base64 of
    # what limits.images lets a request carry
    max_image_body_bytes: int | None = None

    @property
    def max_body_bytes(self) -> int:
        """A generation request's bound (HTTP body, websocket message): `max_message_bytes` of text and settings,
        and room for its images (`max_image_body_bytes`)."""
        room = self.max_image_body_bytes
        return self.max_message_bytes + (self.limits.images.max_body_bytes if room is None else room)
