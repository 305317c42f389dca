"""Well-formed clients that keep sending short requests, each on a thread of its own, recording every
answer: a keep-alive HTTP client, one that opens a new connection for every request (as curl does), and
a /v1/responses websocket. `SteadyClients.run_for(seconds)` drives them all and returns what they got."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass

from websockets.sync.client import connect

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
CREATE = {"type": "response.create", "input": "hello", "max_output_tokens": 2}
CLOSING_EVENTS = ("response.completed", "response.incomplete", "response.failed")


@dataclass(frozen=True)
class Answer:
    """One request's outcome: `ok`, or what went wrong (an HTTP status and error code, an error event, an
    exception's name)."""

    client: str
    finished_at: float
    outcome: str


def _http_outcome(response: http.client.HTTPResponse) -> str:
    payload = response.read()
    if response.status == 200:
        return "ok"
    try:
        return f"{response.status} {json.loads(payload)['error']['code']}"
    except (ValueError, KeyError, TypeError):
        return str(response.status)


class SteadyClients:
    """The three clients against one server."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def run_for(self, seconds: float) -> list[Answer]:
        """Send for `seconds`, then return every answer received meanwhile."""
        self._stop.clear()
        start = len(self.answers)
        threads = [threading.Thread(target=target, daemon=True)
                   for target in (self._keep_alive, self._fresh_connections, self._websocket)]
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        self._stop.set()
        for thread in threads:
            thread.join(timeout=60)
        return self.answers[start:]

    def _record(self, client: str, outcome: str) -> None:
        with self._lock:
            self.answers.append(Answer(client, time.monotonic(), outcome))

    def _post(self, connection: http.client.HTTPConnection, close: bool) -> str:
        headers = {"Content-Type": "application/json", **({"Connection": "close"} if close else {})}
        connection.request("POST", "/v1/chat/completions", json.dumps(CHAT), headers)
        return _http_outcome(connection.getresponse())

    def _keep_alive(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            while not self._stop.is_set():
                try:
                    outcome = self._post(connection, close=False)
                except (OSError, http.client.HTTPException) as error:
                    outcome = type(error).__name__
                    connection.close()
                self._record("keep_alive", outcome)
        finally:
            connection.close()

    def _fresh_connections(self) -> None:
        while not self._stop.is_set():
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                outcome = self._post(connection, close=True)
            except (OSError, http.client.HTTPException) as error:
                outcome = type(error).__name__
            finally:
                connection.close()
            self._record("fresh", outcome)

    def _websocket(self) -> None:
        with connect(f"ws://127.0.0.1:{self.port}/v1/responses") as connection:
            while not self._stop.is_set():
                connection.send(json.dumps(CREATE))
                while True:
                    event = json.loads(connection.recv(timeout=30))
                    if event["type"] == "error":
                        self._record("websocket", f"error {event['error']['code']}")
                        break
                    if event["type"] in CLOSING_EVENTS:
                        self._record("websocket", "ok")
                        break
