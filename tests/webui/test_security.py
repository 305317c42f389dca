"""The page's defences in a real Chromium: markup in a user message and in a model reply (a scripted
model says exactly what the test wants) runs nothing and shows as text; reasoning is folded; with
`--api-key` the page asks for the key, keeps it for the tab only, works once it is typed, and the monitor
refuses a socket without a ticket; a page of another origin can neither read the API nor open the monitor."""

from __future__ import annotations

import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.browser import write_chat_template
from tests.helpers.scripted import write_scripted_model
from tests.helpers.server import make_llm, running_server
from tests.helpers.webui_page import get_json, open_page, send, wait_reply_done

REPLY_IMG = "<img src=x onerror=window.__xssReply=1>"
REPLY_SCRIPT = "<script>window.__xssReplyScript=1</script>"
SCRIPT = ["<think>", "weighing it", "</think>", "Look: ", REPLY_IMG, " and ", REPLY_SCRIPT, " done"]
USER_TEXT = "<img src=x onerror=window.__xssUser=1> <script>window.__xssUserScript=1</script> **bold?**"
GLOBALS = ("__xssReply", "__xssReplyScript", "__xssUser", "__xssUserScript")
API_KEY = "webui-sekrit"


@pytest.fixture(scope="module")
def scripted_llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripted-webui")
    write_scripted_model(folder, SCRIPT)
    return make_llm(write_chat_template(folder), max_model_len=256)


@pytest.fixture(scope="module")
def server(scripted_llm):
    with running_server(scripted_llm, monitor_interval_s=0.1) as background:
        yield background


def globals_set(page) -> dict:
    return page.evaluate(f"() => Object.fromEntries({list(GLOBALS)!r}.map((name) => [name, name in window]))")


def test_markup_in_a_message_and_in_a_reply_runs_nothing_and_shows_as_text(page, server):
    open_page(page, server.port)
    send(page, USER_TEXT)
    wait_reply_done(page)
    assert page.inner_text(".message.user .text") == USER_TEXT
    reply = page.locator(".message.assistant .content").inner_text()
    assert reply == f"Look: {REPLY_IMG} and {REPLY_SCRIPT} done"
    assert page.locator("#messages img, #messages script, #conversation-list img").count() == 0
    assert page.inner_text("#conversation-list .title").startswith("<img src=x")
    page.reload()  # and again when drawn from localStorage
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator(".message.assistant .content").inner_text() == reply
    assert page.locator("#messages img, #messages script").count() == 0
    assert globals_set(page) == dict.fromkeys(GLOBALS, False)


def test_reasoning_is_folded_apart_from_the_answer(page, server):
    open_page(page, server.port)
    send(page, "think first")
    wait_reply_done(page)
    reasoning = page.locator(".message.assistant details.reasoning")
    assert reasoning.get_attribute("open") is None and reasoning.locator(".text").text_content() == "weighing it"
    assert "weighing" not in page.inner_text(".message.assistant .content")
    reasoning.locator("summary").click()
    assert reasoning.locator(".text").is_visible()


@pytest.fixture(scope="module")
def key_server(scripted_llm):
    with running_server(scripted_llm, api_key=API_KEY, monitor_interval_s=0.1) as background:
        yield background


OPEN_MONITOR = """async (ticket) => new Promise((resolve) => {
  const query = ticket === null ? '' : `?ticket=${encodeURIComponent(ticket)}`;
  const socket = new WebSocket(`ws://${location.host}/v1/monitor${query}`);
  socket.onmessage = (message) => { resolve({first: JSON.parse(message.data).type}); socket.close(); };
  socket.onclose = (event) => resolve({closed: event.code});
})"""
TICKET = """async () => (await (await fetch('/v1/monitor/ticket', {method: 'POST',
  headers: {Authorization: `Bearer ${sessionStorage.getItem('localserve.api-key')}`}})).json()).ticket"""


def test_with_a_key_the_page_asks_for_it_and_the_monitor_needs_a_ticket(page, key_server):
    page.goto(f"http://127.0.0.1:{key_server.port}/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "wrong")
    page.press("#key-input", "Enter")
    page.wait_for_function("() => document.querySelector('#key-message').textContent.includes('refused')")
    page.fill("#key-input", API_KEY)
    page.press("#key-input", "Enter")
    page.wait_for_selector("body[data-ready=true]")
    assert page.is_hidden("#key-dialog")
    page.wait_for_function("() => document.querySelector('#map-title').textContent.includes('×')")  # monitor live
    send(page, "hi")
    wait_reply_done(page)
    assert page.locator(".message.assistant .content").inner_text().startswith("Look: ")
    assert page.evaluate("sessionStorage.getItem('localserve.api-key')") == API_KEY
    stored = page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
    assert API_KEY not in stored  # kept for the tab's session only
    assert page.evaluate(OPEN_MONITOR, None) == {"closed": 1006}  # refused at the handshake (401)
    assert page.evaluate(OPEN_MONITOR, "made-up") == {"closed": 1006}
    ticket = page.evaluate(TICKET)
    assert page.evaluate(OPEN_MONITOR, ticket) == {"first": "monitor.hello"}
    assert page.evaluate(OPEN_MONITOR, ticket) == {"closed": 1006}  # a ticket opens one socket
    page.reload()  # the same tab keeps the key
    page.wait_for_selector("body[data-ready=true]")
    assert page.is_hidden("#key-dialog")


class PageSite(BaseHTTPRequestHandler):
    """Another origin on this machine, whose one page runs `script()` against the server on `target_port`."""

    target_port = 0

    def script(self) -> str:
        raise NotImplementedError

    def do_GET(self):
        body = f"<!doctype html><title>elsewhere</title><script>{self.script()}</script>".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class ForeignSite(PageSite):
    """A page of an origin the server does not allow, trying its API and monitor."""

    def script(self) -> str:
        return f"""
window.results = {{}};
fetch('http://127.0.0.1:{self.target_port}/v1/models').then((r) => {{ results.fetch = r.status; }})
  .catch((error) => {{ results.fetch = 'failed: ' + error.message; }});
// A "simple" request goes out without a preflight: only the server's Origin check keeps it from running.
fetch('http://127.0.0.1:{self.target_port}/v1/chat/completions', {{method: 'POST', mode: 'no-cors',
  headers: {{'Content-Type': 'text/plain'}}, body: JSON.stringify({{messages: [{{role: 'user', content: 'hi'}}]}})}})
  .then(() => {{ results.post = 'sent'; }}, () => {{ results.post = 'failed'; }});
const socket = new WebSocket('ws://127.0.0.1:{self.target_port}/v1/monitor');
socket.onmessage = () => {{ results.message = true; }};
socket.onclose = (event) => {{ results.closed = event.code; }};
"""


def test_a_page_of_another_origin_reads_nothing(page, server):
    ForeignSite.target_port = server.port
    site = ThreadingHTTPServer(("127.0.0.1", 0), ForeignSite)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    finished_before = finished_requests(server.port)
    try:
        page.goto(f"http://127.0.0.1:{site.server_address[1]}/")
        page.wait_for_function("() => ['fetch', 'post', 'closed'].every((key) => key in results)")
        results = page.evaluate("results")
    finally:
        site.shutdown()
    assert results == {"fetch": "failed: Failed to fetch", "post": "sent", "closed": 1006}  # no frame came
    assert f"WebSocket connection to 'ws://127.0.0.1:{server.port}/v1/monitor' failed: Error during WebSocket " \
           "handshake: Unexpected response code: 403" in page.log.console_errors
    assert finished_requests(server.port) == finished_before  # the POST that went out ran nothing
    get_json(server.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert finished_requests(server.port) == finished_before + 1  # as one from no browser would have


def finished_requests(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
        return sum(sample.value for family in families if family.name == "localserve_e2e_request_latency_seconds"
                   for sample in family.samples if sample.name.endswith("_count"))


class AllowedSite(PageSite):
    """A page of an origin the server allows (`--allowed-origins`), calling its API the way the official
    JavaScript SDKs do from a browser: their own headers on every request, the key as Anthropic's SDK
    sends it (`x-api-key`) and as OpenAI's does (`Authorization`). Each call goes through a real preflight."""

    def script(self) -> str:
        base = f"http://127.0.0.1:{self.target_port}"
        return f"""
window.results = {{}};
const call = (name, path, headers, body) => fetch('{base}' + path, {{method: 'POST',
  headers: {{'content-type': 'application/json', 'x-stainless-lang': 'js', 'x-stainless-os': 'Linux',
             'x-stainless-package-version': '5.0.0', 'x-stainless-retry-count': '0', ...headers}},
  body: JSON.stringify(body)}})
  .then((r) => r.json().then((b) => {{ results[name] = [r.status, b.type || b.object]; }}))
  .catch((error) => {{ results[name] = 'failed: ' + error.message; }});
call('messages', '/v1/messages', {{'x-api-key': '{API_KEY}', 'anthropic-version': '2023-06-01',
  'anthropic-dangerous-direct-browser-access': 'true'}},
  {{model: 'scripted', max_tokens: 4, messages: [{{role: 'user', content: 'hi'}}]}});
call('chat', '/v1/chat/completions', {{authorization: 'Bearer {API_KEY}', 'openai-beta': 'assistants=v2'}},
  {{model: 'scripted', max_tokens: 4, messages: [{{role: 'user', content: 'hi'}}]}});
call('wrong key', '/v1/chat/completions', {{authorization: 'Bearer nope'}}, {{messages: []}});
"""


def test_an_allowed_origin_calls_the_api_with_the_sdks_headers(page, scripted_llm):
    site = ThreadingHTTPServer(("127.0.0.1", 0), AllowedSite)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{site.server_address[1]}"
    try:
        with running_server(scripted_llm, api_key=API_KEY, allowed_origins=[origin], model_alias="scripted") as server:
            AllowedSite.target_port = server.port
            page.goto(f"{origin}/")
            page.wait_for_function("() => ['messages', 'chat', 'wrong key'].every((key) => key in results)")
            results = page.evaluate("results")
    finally:
        site.shutdown()
    assert results == {"messages": [200, "message"], "chat": [200, "chat.completion"], "wrong key": [401, None]}
