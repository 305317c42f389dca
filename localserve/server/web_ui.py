"""The web page at `/`: the static files of localserve/server/web/, read once, served with safe headers.

`WebUi.from_package()` reads every file under the package's `web/` folder into memory (about 300 KB);
`/` is its `index.html` and every file is at `/webui/<its path>`. Nothing else is reachable: a path is
looked up whole in that table, never joined onto a folder, so `..` or a second slash finds nothing.

Every file goes out with the same headers: a Content-Security-Policy that allows scripts, styles and
connections (the API and the monitor websocket) from this origin only, with no inline script or
style, no plugins, no `<base>`, and no framing; `nosniff`; no referrer; and `Cache-Control: no-cache`
with a strong ETag, so a browser keeps its copy but asks each time whether it still holds (an upgraded
server's page is never stale) and gets a 304 when it does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

STATIC_PREFIX = "/webui/"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".svg": "image/svg+xml", ".png": "image/png", "": "text/plain; charset=utf-8"}
CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'none'", "script-src 'self'", "style-src 'self'", "img-src 'self' data:", "font-src 'self'",
    "connect-src 'self'",  # the HTTP API and, in CSP level 3, the websocket to this host and port
    "object-src 'none'", "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"))
SECURITY_HEADERS = ((b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
                    (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                    (b"x-frame-options", b"DENY"), (b"cross-origin-resource-policy", b"same-origin"),
                    (b"cache-control", b"no-cache"))
# No Cross-Origin-Opener-Policy: a browser ignores it, with a console error, on an origin that is not
# potentially trustworthy (the page over plain HTTP at a LAN address), and the page opens no windows.


@dataclass(frozen=True)
class StaticFile:
    """One file of the page, as it goes out."""

    body: bytes
    content_type: str
    etag: str  # a strong validator: the quoted hash of the body


class WebUi:
    """The page's files by their path under `web/` (`js/main.js`), and the route that finds one."""

    def __init__(self, files: dict[str, StaticFile]) -> None:
        self.files = files

    @classmethod
    def from_package(cls) -> WebUi:
        """The files shipped in the package (localserve/server/web/, package data of the wheel)."""
        root = resources.files("localserve.server").joinpath("web")
        return cls({name: _static_file(name, body) for name, body in _walk(root, "")})

    def find(self, path: str) -> StaticFile | None:
        """The file served at `path` (`/`, or `/webui/...`), or None."""
        if path == "/":
            return self.files.get("index.html")
        if not path.startswith(STATIC_PREFIX):
            return None
        return self.files.get(path.removeprefix(STATIC_PREFIX))

    @staticmethod
    def serves(path: str) -> bool:
        """Whether `path` is the page's to answer (a 404 there if no file has that name)."""
        return path == "/" or path.startswith(STATIC_PREFIX)


def _walk(folder: Traversable, prefix: str) -> list[tuple[str, bytes]]:
    found = []
    for entry in folder.iterdir():
        name = prefix + entry.name
        if entry.is_dir():
            found += _walk(entry, name + "/")
        else:
            found.append((name, entry.read_bytes()))
    return found


def _static_file(name: str, body: bytes) -> StaticFile:
    base = name.rsplit("/", 1)[-1]
    extension = base[base.rfind("."):] if "." in base else ""
    content_type = CONTENT_TYPES.get(extension)
    if content_type is None:
        raise ValueError(f"web/{name}: no content type for {extension!r} files; add one to CONTENT_TYPES")
    return StaticFile(body, content_type, f'"{hashlib.blake2b(body, digest_size=16).hexdigest()}"')
