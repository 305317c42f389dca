"""`localserve chat [URL]`: a terminal chat over the server's /v1/responses websocket.

Each line typed is one `response.create` continuing the previous response (`previous_response_id`),
so the server keeps the conversation and its KV stays in the prefix cache. Lines starting with `/`
are commands (`/help`, see chat_commands.py). The reply streams to stdout as it is generated; a dim
line on stderr then says how many tokens came, how fast, and how much of the prompt the cache held.
In a terminal, lines are edited and recalled with readline (history kept across sessions), and keys
typed while a reply streams neither echo into it nor carry over to the next prompt. Ctrl-C during a
reply sends `response.cancel`; Ctrl-C or Ctrl-D at the prompt quits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

from websockets.exceptions import InvalidStatus, WebSocketException
from websockets.protocol import State
from websockets.sync.client import ClientConnection, connect

from localserve.chat.commands import ChatSettings, QuitChat
from localserve.loading.default_model import cache_dir

try:
    import termios
except ImportError:  # not a POSIX terminal: typed keys cannot be kept out of a reply there
    termios = None

RESPONSES_PATH = "/v1/responses"
CLOSING_EVENTS = ("response.completed", "response.incomplete", "response.failed")
HISTORY_LENGTH = 1000


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


def history_path() -> Path:
    """Where the lines typed in earlier chats are kept (beside localserve's other cached files)."""
    return cache_dir() / "chat_history"


@contextmanager
def keys_kept_out(stream: TextIO) -> Iterator[None]:
    """While a reply streams: typed keys do not echo (they would land in the reply's text) and are
    dropped afterwards (they would otherwise be sent as the next message unseen). Ctrl-C still works."""
    if termios is None or not stream.isatty():
        yield
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~termios.ECHO  # local modes
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def stream_reply(connection: ClientConnection, out: TextIO) -> tuple[dict[str, Any], float | None]:
    """Print the deltas of one response; returns its closing event (or the error event) and the time of
    the first delta (None when none came)."""
    first_delta_at = None
    while True:
        try:
            event = json.loads(connection.recv())
        except KeyboardInterrupt:
            connection.send(json.dumps({"type": "response.cancel"}))
            continue
        if event["type"] == "response.output_text.delta":
            first_delta_at = first_delta_at or time.monotonic()
            out.write(event["delta"])
            out.flush()
        elif event["type"] in CLOSING_EVENTS or event["type"] == "error":
            return event, first_delta_at


def chat_turn(connection: ClientConnection, text: str, out: TextIO, **fields: Any) -> tuple[dict[str, Any], float]:
    """Send one user message and stream the reply; returns the closing event and the seconds the
    reply took from its first token (from the request when no token came)."""
    event = {"type": "response.create", "input": text}
    event.update({name: value for name, value in fields.items() if value is not None})
    started = time.monotonic()
    connection.send(json.dumps(event))
    closing, first_delta_at = stream_reply(connection, out)
    return closing, time.monotonic() - (first_delta_at or started)


def stats_line(response: dict[str, Any], seconds: float) -> str:
    """Tokens, speed and cached prompt tokens of a finished response."""
    usage = response.get("usage") or {}
    num_tokens = usage.get("output_tokens", 0)
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    speed = f"{num_tokens / seconds:.1f} tokens/s" if seconds > 0 and num_tokens > 1 else "-"
    return (f"[{num_tokens} tokens · {speed} · {cached} of {usage.get('input_tokens', 0)} prompt tokens "
            f"from the cache]")


class ChatInput:
    """The user's lines: readline with a prompt and history in a terminal, plain lines otherwise."""

    def __init__(self, lines: TextIO) -> None:
        self.lines = lines
        self.interactive = lines is sys.stdin and lines.isatty()
        self._readline = None
        if self.interactive:
            try:
                import readline  # line editing for input() once imported
            except ImportError:
                return
            self._readline = readline
            readline.set_history_length(HISTORY_LENGTH)
            try:
                readline.read_history_file(history_path())
            except OSError:  # no history yet
                pass

    def read(self) -> str | None:
        """The next line without its newline; None at the end (Ctrl-D or end of input)."""
        if not self.interactive:
            line = self.lines.readline()
            return line.rstrip("\n") if line else None
        try:
            return input("> ")
        except EOFError:
            print(file=sys.stdout)
            return None

    def save_history(self) -> None:
        if self._readline is not None:
            try:
                history_path().parent.mkdir(parents=True, exist_ok=True)
                self._readline.write_history_file(history_path())
            except OSError:  # a read-only home is no reason to fail the chat
                pass


def open_chat(target: str, headers: dict[str, str] | None, err: TextIO) -> ClientConnection | None:
    """The websocket to `target`; None (the reason told on `err`) when it cannot be opened."""
    try:
        return connect(target, additional_headers=headers, max_size=None)
    except InvalidStatus as exc:
        print(f"localserve chat: {target}: refused with HTTP {exc.response.status_code}"
              f"{' (check --api-key)' if exc.response.status_code == 401 else ''}", file=err)
    except (OSError, WebSocketException) as exc:
        print(f"localserve chat: cannot connect to {target}: {exc}", file=err)
    return None


def run_chat(url: str, api_key: str | None = None, model: str | None = None, instructions: str | None = None,
             max_output_tokens: int | None = None, temperature: float | None = None,
             lines: TextIO = sys.stdin, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The interactive loop; returns the process exit code."""
    api_key = api_key or os.environ.get("LOCALSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    target = responses_url(url)
    connection = open_chat(target, headers, err)
    if connection is None:
        return 2
    settings = ChatSettings(instructions=instructions, temperature=temperature, max_output_tokens=max_output_tokens)
    user = ChatInput(lines)
    dim, plain = ("\033[2m", "\033[0m") if err.isatty() else ("", "")
    if user.interactive:
        print(f"localserve chat: connected to {target} (/help lists commands, Ctrl-C stops a reply, "
              "Ctrl-D quits)", file=err)
    with ExitStack() as connections:
        connections.enter_context(connection)
        try:
            while True:
                try:
                    text = user.read()
                except KeyboardInterrupt:
                    return 0
                if text is None:
                    return 0
                if not text.strip():
                    continue
                if text.startswith("/"):
                    try:
                        print(settings.run_command(text), file=err)
                    except ValueError as exc:
                        print(f"localserve chat: {exc}", file=err)
                    continue
                if connection.state is not State.OPEN:
                    # The server closed it while the user was typing (a websocket silent for
                    # --first-event-timeout is): the conversation is kept by the server, a new one goes on.
                    connection = open_chat(target, headers, err)
                    if connection is None:
                        return 2
                    connections.enter_context(connection)
                with keys_kept_out(lines):
                    closing, seconds = chat_turn(connection, text, out, model=model, **settings.create_fields())
                out.write("\n")
                out.flush()
                if closing["type"] == "error":
                    print(f"localserve chat: error: {closing['error']['message']}", file=err)
                    continue
                settings.previous_response_id = closing["response"]["id"]
                if closing["type"] == "response.failed":
                    print(f"localserve chat: the reply failed: {closing['response']['error']['message']}", file=err)
                print(f"{dim}{stats_line(closing['response'], seconds)}{plain}", file=err)
        except QuitChat:
            return 0
        finally:
            user.save_history()
