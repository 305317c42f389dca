"""HTTP/1.1 over a plain socket, byte for byte as written: repeated or malformed headers, odd whitespace,
bytes beyond ASCII, a websocket upgrade whose answer is read as plain HTTP. What a client library would
normalise or refuse to send reaches the server as given.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The headers of a websocket opening handshake (RFC 6455 section 4.1), besides Host
WEBSOCKET_UPGRADE = (("Upgrade", "websocket"), ("Connection", "Upgrade"),
                     ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13"))

Header = tuple[str, str | bytes]


@dataclass(frozen=True)
class RawReply:
    """One HTTP response as it came off the socket."""

    status: int
    headers: list[tuple[str, str]]  # names lower-cased, in order
    body: bytes

    def header(self, name: str) -> str | None:
        values = [value for key, value in self.headers if key == name.lower()]
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error_code(self) -> str | None:
        """The `code` of an OpenAI-shaped error body, or None for any other body."""
        try:
            return self.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return None


def request_bytes(method: str, target: str, headers: Iterable[Header], body: bytes = b"") -> bytes:
    """A request head (and body) with exactly these header lines, in order; values may be raw bytes."""
    lines = [f"{method} {target} HTTP/1.1".encode()]
    for name, value in headers:
        lines.append(name.encode() + b": " + (value if isinstance(value, bytes) else value.encode("latin-1")))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def open_socket(port: int, timeout_s: float = 30.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout_s)


def read_reply(sock: socket.socket, buffered: bytearray | None = None) -> RawReply:
    """The next response on `sock`: its head, then a Content-Length body, or everything up to the close.
    `buffered` holds bytes read past the previous response (keep-alive); what is read past this one is
    left in it."""
    data = buffered if buffered is not None else bytearray()
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed before a whole response head: {bytes(data[:200])!r}")
        data += chunk
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ")[1])
    headers = [(name.strip().lower(), value.strip()) for name, _, value in
               (line.partition(":") for line in header_lines)]
    length = next((int(value) for name, value in headers if name == "content-length"), None)
    body = bytearray(rest)
    if status == 101:
        length = 0
    if length is None:
        while chunk := sock.recv(65536):
            body += chunk
        length = len(body)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    data[:] = body[length:]
    return RawReply(status, headers, bytes(body[:length]))


def exchange(port: int, data: bytes, timeout_s: float = 30.0) -> RawReply:
    """Send `data` on a fresh connection and read one response."""
    with open_socket(port, timeout_s) as sock:
        sock.sendall(data)
        return read_reply(sock)
