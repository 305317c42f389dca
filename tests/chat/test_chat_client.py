"""`localserve chat`: slash commands, the stats line, and, in a real terminal (a pty), line editing with
history and keys typed during a reply kept out of it. Against a scripted Responses server that streams
a fixed reply slowly enough to type into."""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from contextlib import contextmanager

from websockets.sync.server import serve

from localserve.chat.client import run_chat
from tests.helpers.terminal import Terminal

REPLY_WORDS = ["Paris ", "is ", "the ", "capital ", "of ", "France."]


@contextmanager
def scripted_server(delay_s: float = 0.0):
    """A /v1/responses stand-in: every response.create gets REPLY_WORDS as deltas, `delay_s` apart, then
    response.completed with fixed usage; yields (port, the response.create events received)."""
    received: list[dict] = []

    def handle(connection) -> None:
        for message in connection:
            event = json.loads(message)
            if event["type"] != "response.create":
                continue
            received.append(event)
            response_id = f"resp_{len(received)}"
            connection.send(json.dumps({"type": "response.created", "response": {"id": response_id}}))
            for word in REPLY_WORDS:
                time.sleep(delay_s)
                connection.send(json.dumps({"type": "response.output_text.delta", "delta": word}))
            usage = {"input_tokens": 40, "output_tokens": 6, "total_tokens": 46,
                     "input_tokens_details": {"cached_tokens": 32}}
            connection.send(json.dumps({"type": "response.completed",
                                        "response": {"id": response_id, "usage": usage}}))

    with serve(handle, "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.socket.getsockname()[1], received
        finally:
            server.shutdown()
            thread.join(timeout=10)


def test_slash_commands_change_what_the_next_turns_send():
    lines = io.StringIO("/temp 0.5\n/max 7\n/system be brief\nhello\n/temp\n/reset\nhi there\n"
                        "/temp 3\n/max many\n/bogus\n/quit\nnever sent\n")
    out, err = io.StringIO(), io.StringIO()
    with scripted_server() as (port, received):
        assert run_chat(f"127.0.0.1:{port}", lines=lines, out=out, err=err) == 0
    first, second = received  # /quit left before "never sent"
    assert (first["input"], first["temperature"], first["max_output_tokens"], first["instructions"]) == \
        ("hello", 0.5, 7, "be brief")
    assert "previous_response_id" not in first
    assert second["input"] == "hi there" and "temperature" not in second  # /temp alone: the server's default
    assert second["max_output_tokens"] == 7 and second["instructions"] == "be brief"
    assert "previous_response_id" not in second  # /reset
    assert out.getvalue() == "Paris is the capital of France.\n" * 2  # stdout holds the replies only
    messages = err.getvalue()
    assert "/temp must be between 0 and 2, got 3" in messages
    assert "/max needs an integer, got 'many'" in messages
    assert "unknown command /bogus" in messages
    assert messages.count("[6 tokens · ") == 2 and "32 of 40 prompt tokens from the cache]" in messages


def test_turns_continue_the_previous_response_until_reset():
    lines = io.StringIO("one\ntwo\n/reset\nthree\n")
    with scripted_server() as (port, received):
        assert run_chat(f"127.0.0.1:{port}", lines=lines, out=io.StringIO(), err=io.StringIO()) == 0
    assert [event.get("previous_response_id") for event in received] == [None, "resp_1", None]


def test_help_lists_every_command():
    err = io.StringIO()
    with scripted_server() as (port, _):
        run_chat(f"127.0.0.1:{port}", lines=io.StringIO("/help\n"), out=io.StringIO(), err=err)
    for command in ("/help", "/reset", "/system TEXT", "/temp X", "/max N", "/quit"):
        assert command in err.getvalue()


def test_in_a_terminal_typing_during_a_reply_stays_out_and_up_recalls_history(tmp_path):
    env = dict(os.environ, LOCALSERVE_CACHE=str(tmp_path), TERM="xterm")
    with scripted_server(delay_s=0.3) as (port, received):
        terminal = Terminal([sys.executable, "-m", "localserve.cli", "chat", f"127.0.0.1:{port}"], env)
        try:
            terminal.read_until("> ")
            terminal.type("hello\r")
            terminal.read_until("Paris ")
            terminal.type("zzz")  # typed while the reply streams
            terminal.read_until("prompt tokens from the cache]")
            mark = terminal.screen.index("prompt tokens from the cache]")
            terminal.read_until("> ", start=mark)
            time.sleep(0.3)
            terminal.type("\x1b[A\r")  # up: the previous line, then enter
            terminal.read_until("prompt tokens from the cache]", start=mark + 1)
            second = terminal.screen.index("prompt tokens from the cache]", mark + 1)
            # Keys typed before the prompt is back are discarded with the reply's (by design): wait for it.
            terminal.read_until("> ", start=second)
            terminal.type("\x04")  # Ctrl-D
            assert terminal.wait() == 0
        finally:
            terminal.close()
    assert "Paris is the capital of France." in terminal.screen  # not split by what was typed
    assert "zzz" not in terminal.screen  # neither echoed into the reply nor carried to the next prompt
    assert [event["input"] for event in received] == ["hello", "hello"]
    assert (tmp_path / "chat_history").read_text().splitlines()[-1] == "hello"
