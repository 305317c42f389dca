"""`localserve chat` against a real server whose first-event bound passes while the user is typing: the
server closes the silent websocket (1008), and the next line goes out on a new connection, continuing the
same conversation (it is kept by the server), instead of failing on the closed one."""

from __future__ import annotations

import io
import re
import time

from localserve.chat.client import run_chat
from localserve.server.wire.connection_phases import PhaseBounds
from tests.helpers.server import running_server

FIRST_EVENT_S = 0.3


class SlowTypist(io.StringIO):
    """Lines typed one after another, each after `pause_s` of thinking."""

    def __init__(self, text: str, pause_s: float) -> None:
        super().__init__(text)
        self.pause_s = pause_s

    def readline(self, size: int = -1) -> str:
        time.sleep(self.pause_s)
        return super().readline(size)


def test_a_chat_silent_past_the_first_event_bound_goes_on_over_a_new_connection(tiny_chat_llm):
    with running_server(tiny_chat_llm, phase_bounds=PhaseBounds(first_event_s=FIRST_EVENT_S)) as server:
        out, err = io.StringIO(), io.StringIO()
        typist = SlowTypist("hello\ntell me a story\n", pause_s=3 * FIRST_EVENT_S)
        code = run_chat(f"127.0.0.1:{server.port}", max_output_tokens=4, temperature=0, lines=typist, out=out,
                        err=err)
        assert code == 0, err.getvalue()
        stats = [line for line in err.getvalue().splitlines() if line.startswith("[")]
        assert len(stats) == 2 and "error" not in err.getvalue()  # both turns answered
        assert "4 tokens" in stats[0] and "4 tokens" in stats[1]
        first, second = (int(re.search(r"of (\d+) prompt tokens", line).group(1)) for line in stats)
        # the second turn continued the first: its prompt holds the first prompt and reply before its own words
        assert second >= first + 4 + len("tell me a story".split())
