"""Who may talk to the server, decided from the HTTP request before anything else (no I/O here).

`check_access` returns the refusal (status, code, message) or None:
- one `Host`, `Origin`, `Authorization` and `x-api-key` header at most: a duplicate is ambiguous (400);
- the `Host` header must be `name[:port]` and name this server: a loopback name, an IP address, `--host`
  or one of `--allowed-hosts` (any case), so a DNS-rebinding page (whose Host is its own domain) can read
  nothing (403); the port is not checked (a port forward names the server by its own);
- a browser `Origin` must be the server's own or one of `--allowed-origins`, compared as browsers compare
  origins: scheme, host and port, the first two in any case, a default port written or not (403);
- with an API key, `Authorization: Bearer KEY`: the scheme in any case, then spaces, then exactly the
  key's bytes (compared in constant time), or `x-api-key: KEY` (exactly the key's bytes: Anthropic's
  clients send it so); nothing else carries the key (401).

Every name is matched whole, never as a prefix or suffix, and only over ASCII: a header value is
decoded as ISO-8859-1, where Python sees whitespace (U+00A0, U+0085) that HTTP does not.

A browser cannot set headers on a websocket, so the web page opens `/v1/monitor` with a ticket instead
of the key: `MonitorTickets` hands out random tickets (to `POST /v1/monitor/ticket`, which needs the
key) that are good once, for `TICKET_LIFETIME_S`.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from websockets.datastructures import Headers

from localserve.server.config import ServerConfig

SINGLE_HEADERS = ("Host", "Origin", "Authorization", "X-Api-Key")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
# RFC 3986's host: an IPv6 literal in brackets, or a name of unreserved characters (which covers IPv4)
URI_HOST = r"(?P<name>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]+)"
HOST_HEADER = re.compile(URI_HOST + r"(?::[0-9]*)?", re.ASCII)  # RFC 9110 7.2: uri-host [ ":" port ]
SERIALIZED_ORIGIN = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://" + URI_HOST + r"(?::(?P<port>[0-9]+))?/?",
                               re.ASCII)
DEFAULT_PORTS = {"http": 80, "https": 443}
TICKET_LIFETIME_S = 30.0  # from POST /v1/monitor/ticket to the websocket's handshake
MAX_OUTSTANDING_TICKETS = 64  # tickets issued and not used; beyond, the oldest is forgotten


@dataclass(frozen=True)
class Refusal:
    status: HTTPStatus
    code: str
    message: str


@dataclass(frozen=True)
class AccessPolicy:
    """The names this server answers to, the browser origins it accepts, and its key."""

    allowed_hosts: frozenset[str]  # lower-case host names without port; "*" allows any
    allowed_origins: frozenset[str]  # each as `origin_key` gives it
    api_key: str | None

    @classmethod
    def build(cls, host: str, port: int, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...],
              api_key: str | None) -> AccessPolicy:
        hosts = {name.lower() for name in (*LOOPBACK_NAMES, host, *allowed_hosts)}
        own_origins = [f"http://{name}:{port}" for name in (*LOOPBACK_NAMES, host)]
        return cls(frozenset(hosts), frozenset(origin_key(origin) for origin in (*own_origins, *allowed_origins)),
                   api_key)

    def host_allowed(self, host_header: str) -> bool:
        """True for a Host naming this server; an IP address is always fine (rebinding needs a domain)."""
        if "*" in self.allowed_hosts:
            return True
        match = HOST_HEADER.fullmatch(host_header)
        if match is None:  # userinfo, a path, a list, a malformed port: no client names a server so
            return False
        name = match["name"].lower()
        return _is_ip_address(name) or name in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        """True for this server's own origin and the allowed ones."""
        return origin_key(origin) in self.allowed_origins


def origin_key(origin: str) -> str:
    """An origin as browsers compare them (RFC 6454): `scheme://host:port`, scheme and host in lower case,
    the default port spelled out; what is not an origin (`null`, a URL with a path) stays as written."""
    match = SERIALIZED_ORIGIN.fullmatch(origin)
    if match is None:
        return origin
    scheme, name = match["scheme"].lower(), match["name"].lower()
    port = int(match["port"]) if match["port"] else DEFAULT_PORTS.get(scheme)
    return f"{scheme}://{name}" if port is None else f"{scheme}://{name}:{port}"


def _is_ip_address(name: str) -> bool:
    """An IPv4 address, or an IPv6 one in brackets (a bare IPv6 address is not a Host)."""
    try:
        if name.startswith("["):
            ipaddress.IPv6Address(name[1:-1])
        else:
            ipaddress.IPv4Address(name)
        return True
    except ValueError:
        return False


def check_access(headers: Headers, policy: AccessPolicy, needs_key: bool = True) -> Refusal | None:
    """The refusal for a request with these headers, or None when it may go on."""
    for name in SINGLE_HEADERS:
        if len(headers.get_all(name)) > 1:
            return Refusal(HTTPStatus.BAD_REQUEST, "duplicate_header", f"the {name} header appears more than "
                           "once; send it once")
    host = headers.get("Host")
    if host is None or not policy.host_allowed(host):
        return Refusal(HTTPStatus.FORBIDDEN, "host_not_allowed", f"Host {host!r} does not name this "
                       "server; start it with --allowed-hosts to answer to that name")
    origin = headers.get("Origin")
    if origin is not None and not policy.origin_allowed(origin):
        return Refusal(HTTPStatus.FORBIDDEN, "origin_not_allowed", f"Origin {origin!r} may not use this "
                       "server; start it with --allowed-origins to allow it")
    if needs_key and policy.api_key is not None and not _has_key(headers, policy.api_key):
        return Refusal(HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or wrong API key: send "
                       "'Authorization: Bearer KEY' or 'x-api-key: KEY'")
    return None


def _has_key(headers: Headers, api_key: str) -> bool:
    # RFC 9110 11.4: credentials = auth-scheme 1*SP token; the parser has stripped whitespace around the value
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    # the value holds the bytes as sent (decoded as ISO-8859-1); the key is sent as UTF-8
    if scheme.lower() == "bearer" and hmac.compare_digest(token.lstrip(" ").encode("latin-1"), api_key.encode()):
        return True
    x_api_key = headers.get("X-Api-Key")
    return x_api_key is not None and hmac.compare_digest(x_api_key.encode("latin-1"), api_key.encode())


class MonitorTickets:
    """Single-use tickets that stand for the API key on one `/v1/monitor` handshake.

    A ticket is 256 random bits (URL-safe), good for `lifetime_s` after it is issued and only for the
    first handshake that shows it; at most `max_outstanding` wait at once (a client that asks for many
    and uses none only pushes out its own). It appears in the websocket's URL, where logs may keep it:
    by then it is spent.
    """

    def __init__(self, lifetime_s: float = TICKET_LIFETIME_S, max_outstanding: int = MAX_OUTSTANDING_TICKETS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lifetime_s, self.max_outstanding, self._clock = lifetime_s, max_outstanding, clock
        self._expiries: OrderedDict[str, float] = OrderedDict()  # ticket -> when it expires, oldest first

    def issue(self) -> str:
        """A new ticket."""
        ticket = secrets.token_urlsafe(32)
        self._expiries[ticket] = self._clock() + self.lifetime_s
        while len(self._expiries) > self.max_outstanding:
            self._expiries.popitem(last=False)
        return ticket

    def redeem(self, ticket: str) -> bool:
        """True once for a ticket issued within its lifetime; it is spent either way."""
        expires_at = self._expiries.pop(ticket, None)
        return expires_at is not None and self._clock() < expires_at


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
