"""`localserve chat [URL]`: a terminal chat over the server's /v1/responses websocket.

Each line typed is one `response.create` continuing the previous response (`previous_response_id`),
so the server keeps the conversation and its KV stays in the prefix cache. The reply streams as it
is generated; Ctrl-C during a reply sends `response.cancel`, Ctrl-C or Ctrl-D at the prompt quits.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

from websockets.exceptions import InvalidStatus, WebSocketException
from websockets.sync.client import ClientConnection, connect

RESPONSES_PATH = "/v1/responses"
CLOSING_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def responses_url(url: str) -> str:
    """ws://host:port[/v1/responses] from what the user typed (http:// and a bare host:port work too)."""
    if "://" not in url:
        url = f"ws://{url}"
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/")
    if not path.endswith(RESPONSES_PATH):
        path = path.removesuffix("/v1") + RESPONSES_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def stream_reply(connection: ClientConnection, out: TextIO) -> dict[str, Any]:
    """Print the deltas of one response; returns its closing event (or the error event)."""
    while True:
        try:
            event = json.loads(connection.recv())
        except KeyboardInterrupt:
            connection.send(json.dumps({"type": "response.cancel"}))
            continue
        if event["type"] == "response.output_text.delta":
            out.write(event["delta"])
            out.flush()
        elif event["type"] in CLOSING_EVENTS or event["type"] == "error":
            return event


def chat_turn(connection: ClientConnection, text: str, previous_response_id: str | None, out: TextIO,
              **settings: Any) -> dict[str, Any]:
    """Send one user message and stream the reply; returns the closing event."""
    event = {"type": "response.create", "input": text, "previous_response_id": previous_response_id}
    event.update({name: value for name, value in settings.items() if value is not None})
    connection.send(json.dumps(event))
    return stream_reply(connection, out)


def run_chat(url: str, api_key: str | None = None, model: str | None = None, instructions: str | None = None,
             max_output_tokens: int | None = None, temperature: float | None = None,
             lines: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """The interactive loop; returns the process exit code."""
    api_key = api_key or os.environ.get("LOCALSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    target = responses_url(url)
    try:
        connection = connect(target, additional_headers=headers, max_size=None)
    except InvalidStatus as exc:
        print(f"localserve chat: {target}: refused with HTTP {exc.response.status_code}"
              f"{' (check --api-key)' if exc.response.status_code == 401 else ''}", file=sys.stderr)
        return 2
    except (OSError, WebSocketException) as exc:
        print(f"localserve chat: cannot connect to {target}: {exc}", file=sys.stderr)
        return 2
    interactive = lines.isatty()
    if interactive:
        print(f"localserve chat: connected to {target} (Ctrl-C stops a reply, Ctrl-D quits)", file=sys.stderr)
    previous_response_id = None
    with connection:
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            try:
                text = lines.readline()
            except KeyboardInterrupt:
                return 0
            if not text:
                return 0
            if not text.strip():
                continue
            closing = chat_turn(connection, text.rstrip("\n"), previous_response_id, out, model=model,
                                instructions=instructions, max_output_tokens=max_output_tokens,
                                temperature=temperature)
            out.write("\n")
            if closing["type"] == "error":
                print(f"localserve chat: error: {closing['error']['message']}", file=sys.stderr)
                continue
            previous_response_id = closing["response"]["id"]
            if closing["type"] == "response.failed":
                print(f"localserve chat: the reply failed: {closing['response']['error']['message']}",
                      file=sys.stderr)
