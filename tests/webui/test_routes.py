"""The web page's routes on the HTTP API (server/http_app.py, server/web_ui.py), no browser: `GET /` and
the files under `/webui/` with their content types and safety headers, served without the API key (the
page must load to ask for it) but behind the Host and Origin checks; `If-None-Match` answered with 304;
`--no-webui` (ServerConfig.web_ui False) leaves `/` a 404; every file the page references exists."""

from __future__ import annotations

import re

import pytest

from localserve.server.web_ui import STATIC_PREFIX, WebUi
from tests.helpers.http_api import API_KEY, KEY, Api, response

CSP_DIRECTIVES = {"script-src 'self'", "style-src 'self'", "connect-src 'self'", "frame-ancestors 'none'",
                  "object-src 'none'", "base-uri 'none'"}


def test_the_page_is_served_at_the_root_with_a_strict_policy_and_no_key():
    api = Api(api_key=API_KEY)
    status, headers, body = response(api.get("/"))
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert b'<script type="module" src="/webui/js/main.js"></script>' in body
    directives = {directive.strip() for directive in headers["content-security-policy"].split(";")}
    assert CSP_DIRECTIVES <= directives
    assert "'unsafe-inline'" not in headers["content-security-policy"]
    assert "'unsafe-eval'" not in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff" and headers["referrer-policy"] == "no-referrer"
    assert headers["cache-control"] == "no-cache" and re.fullmatch(r'"[0-9a-f]{32}"', headers["etag"])
    assert int(headers["content-length"]) == len(body)
    assert response(api.get("/v1/models"))[0] == 401  # the API itself still needs the key
    assert response(api.get("/v1/models", KEY))[0] == 200


@pytest.mark.parametrize("path, content_type", [
    ("/webui/js/main.js", "text/javascript; charset=utf-8"), ("/webui/app.css", "text/css; charset=utf-8"),
    ("/webui/favicon.svg", "image/svg+xml"), ("/webui/vendor/marked/LICENSE", "text/plain; charset=utf-8"),
    ("/webui/vendor/dompurify/purify.es.mjs", "text/javascript; charset=utf-8"),
])
def test_static_files_have_their_content_types_and_the_same_headers(path, content_type):
    status, headers, body = response(Api(api_key=API_KEY).get(path))
    assert status == 200 and headers["content-type"] == content_type and body
    assert headers["x-content-type-options"] == "nosniff" and "frame-ancestors 'none'" in headers[
        "content-security-policy"]


def test_a_cached_copy_is_revalidated_with_its_etag():
    api = Api()
    _, headers, _ = response(api.get("/webui/js/main.js"))
    status, again, body = response(api.get("/webui/js/main.js", {"If-None-Match": headers["etag"]}))
    assert status == 304 and body == b"" and again["etag"] == headers["etag"]
    assert response(api.get("/webui/js/main.js", {"If-None-Match": '"other"'}))[0] == 200


@pytest.mark.parametrize("path", ["/webui/", "/webui/nothing.js", "/webui/../pyproject.toml", "/webui/js",
                                  "/index.html", "/webui//js/main.js", "/webui/js/../js/main.js"])
def test_anything_but_a_shipped_file_is_not_found(path):
    assert response(Api().get(path))[0] == 404


def test_the_page_passes_the_host_and_origin_checks_first():
    api = Api()
    assert response(api.get("/", {"Host": "evil.example"}))[0] == 403  # a rebinding page reads nothing
    assert response(api.get("/", {"Origin": "http://evil.example"}))[0] == 403
    assert response(api.get("/", {"Origin": "http://localhost:3000"}))[0] == 200  # --allowed-origins


def test_no_webui_leaves_the_root_not_found():
    api = Api(web_ui=False)
    status, _, body = response(api.get("/"))
    assert status == 404 and b"no such path: /" in body
    assert response(api.get("/webui/js/main.js"))[0] == 404


def test_every_file_the_page_references_is_shipped():
    site = WebUi.from_package()
    html = site.files["index.html"].body.decode()
    references = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert references and all(ref.startswith(STATIC_PREFIX) for ref in references)
    assert all(ref.removeprefix(STATIC_PREFIX) in site.files for ref in references)
    for name, static in site.files.items():  # every module import resolves to a shipped file
        if not name.endswith((".js", ".mjs")):
            continue
        for target in re.findall(r'^import .* from "(\.[^"]+)";$', static.body.decode(), re.MULTILINE):
            folder = name.rsplit("/", 1)[0] if "/" in name else ""
            parts = [part for part in f"{folder}/{target}".split("/") if part not in ("", ".")]
            resolved = []
            for part in parts:
                resolved = resolved[:-1] if part == ".." else [*resolved, part]
            assert "/".join(resolved) in site.files, f"{name} imports {target}"
