"""A load of many websocket clients over loopback, for the load test and scripts/load_test.py.

Each client holds one connection with one or two lanes (`stream_id`; one client in two uses the
default lane for its first), and on each lane a conversation of a few turns chained with
`previous_response_id`. Half the turns are greedy, the others sample with random parameters (top_k,
top_p, min_p, seeds, stop strings, n, log-probabilities). One client in ten cancels a response
mid-stream, one in ten disconnects mid-stream (a reset, no closing handshake). Every turn is
recorded with how it ended; greedy turns keep their whole conversation so that `replay_alone` can
send each again, alone, and compare.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.helpers.server import WORDS

CLOSINGS = {"response.completed": "completed", "response.incomplete": "incomplete", "response.failed": "failed"}


@dataclass(frozen=True)
class LoadConfig:
    num_clients: int = 256
    min_turns: int = 2
    max_turns: int = 3
    min_output_tokens: int = 4
    max_output_tokens: int = 16
    greedy_fraction: float = 0.5
    cancel_fraction: float = 0.1
    disconnect_fraction: float = 0.1
    two_lane_fraction: float = 0.3
    seed: int = 0
    event_timeout_s: float = 120.0  # no event for this long on a lane waiting for one: the turn is lost


@dataclass
class Turn:
    """One response.create and how it ended."""

    client: int
    lane: str | None
    greedy: bool
    messages: list[dict[str, str]]  # the whole conversation sent (history + this input)
    instructions: str | None
    max_output_tokens: int
    outcome: str = "lost"  # completed | incomplete | cancelled | failed | error:CODE | abandoned | lost
    text: str = ""
    response_id: str | None = None
    cached_tokens: int = 0


@dataclass
class LoadReport:
    turns: list[Turn] = field(default_factory=list)
    duration_s: float = 0.0

    def outcomes(self) -> Counter:
        return Counter(turn.outcome.split(":")[0] for turn in self.turns)

    @property
    def lost(self) -> list[Turn]:
        """Turns with no final event and no reason (a failure needs a reason to count as an answer)."""
        return [turn for turn in self.turns if turn.outcome == "lost"]


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _sampling(rng: random.Random, first_turn: bool) -> dict:
    fields: dict = {"temperature": round(rng.uniform(0.3, 1.5), 3)}
    extension: dict = {}
    if rng.random() < 0.5:
        fields["top_p"] = round(rng.uniform(0.5, 1.0), 3)
    if rng.random() < 0.3:
        fields["top_logprobs"] = rng.randint(0, 3)
    for name, value in (("top_k", rng.randint(1, 100)), ("min_p", round(rng.uniform(0, 0.2), 3)),
                        ("seed", rng.randint(-(2 ** 63), 2 ** 63 - 1)), ("n", 2), ("stop", rng.choice(WORDS))):
        # two samples only while the prompt is short: the pool must be able to hold both on their own
        if rng.random() < 0.3 and (name != "n" or first_turn):
            extension[name] = value
    if extension:
        fields["localserve"] = extension
    return fields


class _Client:
    def __init__(self, index: int, url: str, config: LoadConfig, report: LoadReport) -> None:
        self.index, self.url, self.config, self.report = index, url, config, report
        self.rng = random.Random(config.seed * 1_000_003 + index)
        roll = self.rng.random()
        self.behaviour = ("cancel" if roll < config.cancel_fraction else
                          "disconnect" if roll < config.cancel_fraction + config.disconnect_fraction else "normal")
        self.queues: dict[str | None, asyncio.Queue] = {}
        self.disconnected = asyncio.Event()

    async def run(self) -> None:
        lanes = [None if self.rng.random() < 0.5 else "main"]
        if self.rng.random() < self.config.two_lane_fraction:
            lanes.append("side")
        self.queues = {lane: asyncio.Queue() for lane in lanes}
        # the lane and turn on which this client cancels or disconnects, after the first delta
        self.misbehave_at = (self.rng.choice(lanes), self.rng.randint(0, self.config.min_turns - 1))
        async with connect(self.url, max_size=None, open_timeout=120) as connection:
            reader = asyncio.create_task(self._read(connection))
            try:
                await asyncio.gather(*(self._conversation(connection, lane) for lane in lanes))
            finally:
                reader.cancel()

    async def _read(self, connection) -> None:
        try:
            async for message in connection:
                event = json.loads(message)
                self.queues[event.get("stream_id")].put_nowait(event)
        except ConnectionClosed:
            pass

    async def _conversation(self, connection, lane: str | None) -> None:
        rng, config = self.rng, self.config
        history: list[dict[str, str]] = []
        previous_id = None
        instructions = "be brief" if rng.random() < 0.3 else None
        for turn_index in range(rng.randint(config.min_turns, config.max_turns)):
            if self.disconnected.is_set():
                return
            user = {"role": "user", "content": _words(rng, 3, 12)}
            greedy = rng.random() < config.greedy_fraction
            turn = Turn(self.index, lane, greedy, history + [user], instructions,
                        rng.randint(config.min_output_tokens, config.max_output_tokens))
            self.report.turns.append(turn)
            create = {"type": "response.create", "input": [user], "max_output_tokens": turn.max_output_tokens,
                      **({"temperature": 0} if greedy else _sampling(rng, not history))}
            if lane is not None:
                create["stream_id"] = lane
            if instructions:
                create["instructions"] = instructions
            if previous_id is not None:
                create["previous_response_id"] = previous_id
            else:
                create["input"] = history + [user]
            try:
                await connection.send(json.dumps(create))
                await self._follow(connection, turn, (lane, turn_index) == self.misbehave_at)
            except ConnectionClosed:
                turn.outcome = "abandoned" if self.disconnected.is_set() else "lost"
                return
            if turn.outcome.startswith(("completed", "incomplete", "cancelled")):
                history, previous_id = history + [user, {"role": "assistant", "content": turn.text}], \
                    turn.response_id
            elif turn.outcome == "abandoned":
                return
            else:
                previous_id = None  # start over from the history the client holds

    async def _follow(self, connection, turn: Turn, misbehave: bool) -> None:
        """Read this lane's events until the turn's final event (cancelling or vanishing on the way)."""
        queue = self.queues[turn.lane]
        cancel_sent = False
        while True:
            getter = asyncio.ensure_future(queue.get())
            gone = asyncio.ensure_future(self.disconnected.wait())
            done, _ = await asyncio.wait({getter, gone}, timeout=self.config.event_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            for waiter in (getter, gone):
                waiter.cancel()
            if getter not in done:
                turn.outcome = "abandoned" if gone in done else "lost"
                return
            event = getter.result()
            kind = event["type"]
            if kind == "error":
                if event["error"]["code"] == "response_cancel_not_active":
                    continue  # a cancel that came after its response had ended: no request's answer
                turn.outcome = f"error:{event['error']['code']}"
                return
            if kind == "response.created":
                turn.response_id = event["response"]["id"]
            elif kind == "response.output_text.delta" and misbehave and not cancel_sent:
                if self.behaviour == "cancel":
                    await connection.send(json.dumps({"type": "response.cancel", "stream_id": turn.lane}))
                    cancel_sent = True
                elif self.behaviour == "disconnect":
                    self.disconnected.set()
                    connection.transport.abort()  # gone: no closing handshake
                    turn.outcome = "abandoned"
                    return
            elif kind in CLOSINGS:
                response = event["response"]
                turn.outcome = "cancelled" if response["status"] == "cancelled" else CLOSINGS[kind]
                if turn.outcome == "failed":
                    turn.outcome += f":{(response.get('error') or {}).get('message') or 'no reason'}"
                if response["output"]:
                    turn.text = response["output"][0]["content"][0]["text"]
                turn.cached_tokens = response["usage"]["input_tokens_details"]["cached_tokens"]
                return


async def run_load(port: int, config: LoadConfig) -> LoadReport:
    """Run `config.num_clients` clients at once against the server on `port`."""
    report = LoadReport()
    url = f"ws://127.0.0.1:{port}/v1/responses"
    start = time.monotonic()
    await asyncio.gather(*(_Client(index, url, config, report).run() for index in range(config.num_clients)))
    report.duration_s = time.monotonic() - start
    return report


async def replay_alone(port: int, turns: list[Turn]) -> list[tuple[Turn, str]]:
    """Send each greedy turn again, one at a time, as one request with its whole conversation; returns
    the turns whose text differs, with the text it got alone."""
    mismatches = []
    async with connect(f"ws://127.0.0.1:{port}/v1/responses", max_size=None) as connection:
        for turn in turns:
            create = {"type": "response.create", "input": turn.messages, "temperature": 0,
                      "max_output_tokens": turn.max_output_tokens}
            if turn.instructions:
                create["instructions"] = turn.instructions
            await connection.send(json.dumps(create))
            while (event := json.loads(await connection.recv()))["type"] not in CLOSINGS:
                assert event["type"] != "error", event
            text = event["response"]["output"][0]["content"][0]["text"]
            if text != turn.text:
                mismatches.append((turn, text))
    return mismatches
