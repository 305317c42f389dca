"""Who may talk to the server, decided from the HTTP request before anything else (no I/O here).

`check_access` returns the refusal (status, code, message) or None:
- one `Host`, `Origin` and `Authorization` header at most: a duplicate is ambiguous (400);
- the `Host` header must name this server: a loopback name, an IP address, `--host` or one of
  `--allowed-hosts`, so a DNS-rebinding page (whose Host is its own domain) can read nothing (403);
- a browser `Origin` must be the server's own or one of `--allowed-origins` (403);
- with an API key, `Authorization: Bearer KEY` (401).
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

from websockets.datastructures import Headers

SINGLE_HEADERS = ("Host", "Origin", "Authorization")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")


@dataclass(frozen=True)
class Refusal:
    status: HTTPStatus
    code: str
    message: str


@dataclass(frozen=True)
class AccessPolicy:
    """The names this server answers to, the browser origins it accepts, and its key."""

    allowed_hosts: frozenset[str]  # lower-case host names without port; "*" allows any
    allowed_origins: frozenset[str]
    api_key: str | None

    @classmethod
    def build(cls, host: str, port: int, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...],
              api_key: str | None) -> AccessPolicy:
        hosts = {name.lower() for name in (*LOOPBACK_NAMES, host, *allowed_hosts)}
        own_origins = {f"http://{name}:{port}" for name in ("127.0.0.1", "localhost", "[::1]", host)}
        return cls(frozenset(hosts), frozenset(own_origins | {origin.rstrip("/") for origin in allowed_origins}),
                   api_key)

    def host_allowed(self, host_header: str) -> bool:
        """True for a Host naming this server; an IP address is always fine (rebinding needs a domain)."""
        if "*" in self.allowed_hosts:
            return True
        try:
            hostname = urlsplit(f"//{host_header}").hostname  # strips the port and IPv6 brackets
        except ValueError:  # a malformed port or bracket
            return False
        if not hostname:
            return False
        try:
            ipaddress.ip_address(hostname)
            return True
        except ValueError:
            return hostname in self.allowed_hosts or f"[{hostname}]" in self.allowed_hosts


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
    if origin is not None and origin.rstrip("/") not in policy.allowed_origins:
        return Refusal(HTTPStatus.FORBIDDEN, "origin_not_allowed", f"Origin {origin!r} may not use this "
                       "server; start it with --allowed-origins to allow it")
    if needs_key and policy.api_key is not None and not _has_key(headers, policy.api_key):
        return Refusal(HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or wrong API key: send "
                       "'Authorization: Bearer KEY'")
    return None


def _has_key(headers: Headers, api_key: str) -> bool:
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())
