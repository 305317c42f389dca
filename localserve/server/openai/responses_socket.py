"""One `/v1/responses` websocket connection: its receive loop, its lanes, its sender and its keepalive.

The receive loop checks each client event and never waits on anything else: a `response.create`
joins its lane (`stream_id`; no `stream_id` is the default lane). Lanes run at the same time; within
a lane, responses run one after another in arrival order, each started by that lane's task through
the `GenerationService`. The service absorbs the engine's outputs into each response's stream on the
event loop and wakes the sender; the sender alone writes to the socket, draining every live stream
(text piles up as fewer, longer deltas for a slow reader, never as a growing queue).

Every wait on the client is bounded: the first event must come within `phase_bounds.first_event_s` of
the opening (until then the connection is unfinished, and may be evicted for a newer one; see
server/wire/connection_phases.py), while `send_queue_size` error events wait to be sent, nothing
more is read from the client (one that floods and never reads is cut after `send_timeout_s`), each
frame must be taken within `send_timeout_s` (the write buffer is capped by `write_limit_bytes`), and a
ping must be answered within that time. A cut or vanished client's
responses are aborted at once and its connection slot returned.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from localserve.server.config import INLINE_PARSE_BYTES, ServerConfig
from localserve.server.generation.service import GenerationService
from localserve.server.generation.stream import GenerationStream, new_id
from localserve.server.openai.responses_events import ResponsesEvents
from localserve.server.openai.responses_format import (
    RESPONSES_WEBSOCKET,
    check_stream_id,
    event_stream_id,
    parse_client_event,
)
from localserve.server.request.fields import parse_request
from localserve.server.request.generation_request import GenerationRequest
from localserve.server.request.validation import ProtocolError, error_event, shown
from localserve.server.wire.closing import CLOSE_TIMEOUT_S, close_within
from localserve.server.wire.connection_phases import EVICTED_REASON, LIMIT_REACHED_REASON, FirstEventWait

log = logging.getLogger(__name__)

class ClientTooSlow(Exception):
    """The client stopped taking frames, or sent nothing in time: it is cut (close code 1008)."""


class NoRoom(Exception):
    """The server keeps no place for this connection (evicted, or beyond max_connections): close code 1013."""


@dataclass
class Lane:
    """The responses of one `stream_id`: the one running and those waiting for it, in order."""

    stream_id: str | None
    waiting: deque[GenerationRequest] = field(default_factory=deque)
    current: GenerationStream | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set when `current` ends
    task: asyncio.Task | None = None
    starting: bool = False  # a response is being tokenized and submitted
    cancel_on_start: bool = False  # response.cancel arrived before the next response had started


class ResponsesSession:
    """Serves one client: lanes of responses over one connection, as in OpenAI's WebSocket mode."""

    def __init__(self, config: ServerConfig, responses: GenerationService, connection: ServerConnection,
                 first_event: FirstEventWait) -> None:
        self.config, self.responses, self.connection = config, responses, connection
        self.first_event = first_event
        self.owner = new_id("conn")  # whose store: false conversations these are
        self.lanes: dict[str | None, Lane] = {}
        self.views: list[ResponsesEvents] = []  # the responses started and not all sent, in start order
        self.errors: deque[dict[str, Any]] = deque()
        self._wake = asyncio.Event()
        self._shutting_down = False
        self._ending = False  # the connection is over: loops stop even if a cancellation got lost
        self._errors_taken = asyncio.Event()  # the sender took error events off the queue
        self.close_code, self.close_reason = 1000, ""

    @property
    def num_waiting(self) -> int:
        return sum(len(lane.waiting) for lane in self.lanes.values())

    async def run(self) -> None:
        """Serve until the client goes away or is cut; then abort whatever is still running."""
        tasks = [asyncio.create_task(coroutine) for coroutine in (
            self._receive_loop(), self._send_loop(), self._keepalive())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if isinstance(error, ClientTooSlow):
                    self.close_code, self.close_reason = 1008, str(error)
                elif isinstance(error, NoRoom):
                    self.close_code, self.close_reason = 1013, str(error)
                elif error is not None and not isinstance(error, ConnectionClosed):
                    raise error
        finally:
            self._ending = True
            self._wake.set()
            for task in tasks:
                task.cancel()
            self._abandon_all()
            # asyncio.wait_for may swallow a cancellation that meets a finished send: the flag above
            # ends those loops anyway, and nothing here waits on them for more than a moment
            ended, _ = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
            for task in ended:  # whatever they raised, the connection is over
                if not task.cancelled():
                    task.exception()
            await close_within(self.connection, self.close_code, self.close_reason)

    def shut_down(self) -> None:
        """The server is stopping: end every response (`server_shutdown`), send what is left, then close."""
        self._shutting_down = True
        self.close_code, self.close_reason = 1001, "server shutting down"
        for lane in list(self.lanes.values()):
            for request in lane.waiting:
                self._send_error(ProtocolError("server_shutdown", "the server is shutting down; this request "
                                               "never started", status=503), request.stream_id)
            lane.waiting.clear()
            if lane.current is not None:
                self.responses.shut_down(lane.current)
        self._wake.set()

    # ------------------------------------------------------------------ receiving
    async def _receive_loop(self) -> None:
        frames = aiter(self.connection)
        try:
            first = await self._first_event(frames)
        except StopAsyncIteration:  # the client closed without a word
            return
        await self._receive(first)
        async for frame in frames:
            await self._receive(frame)

    async def _first_event(self, frames: AsyncIterator[Any]) -> Any:
        """The client's first frame. Until it comes the connection is unfinished: evicted for a newer one
        (1013), or cut once `first_event_s` has passed (1008); when it comes, it takes a place among
        max_connections, or is refused (an error event, then 1013)."""
        wait, bounds, loop = self.first_event, self.config.phase_bounds, asyncio.get_running_loop()
        deadline = loop.time() + bounds.first_event_s
        receive = asyncio.ensure_future(anext(frames))
        evicted = asyncio.ensure_future(wait.evicted.wait())
        try:
            done, _ = await asyncio.wait((receive, evicted), timeout=bounds.first_event_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if wait.evicted.is_set():  # closed after the linger, or at the bound if sooner (see PhaseBounds)
                await asyncio.sleep(max(0.0, min(bounds.evicted_linger_s, deadline - loop.time())))
                raise NoRoom(EVICTED_REASON)
            if receive not in done:
                wait.timed_out()
                raise ClientTooSlow(f"no event within {bounds.first_event_s:g} s of opening")
            frame = receive.result()  # the end of the stream, or a closed connection, goes up from here
        finally:
            receive.cancel()  # no-op once done; websockets' recv may be cancelled without losing a frame
            evicted.cancel()
        try:
            wait.arrived()
        except ProtocolError as error:
            await self._send(error_event(error))
            raise NoRoom(LIMIT_REACHED_REASON) from None
        return frame

    async def _receive(self, frame: Any) -> None:
        if self._shutting_down:
            return
        if len(self.errors) >= self.config.send_queue_size:
            await self._wait_for_errors_taken()
        stream_id = None
        try:
            event = parse_client_event(frame)
            stream_id = event_stream_id(event)
            if event["type"] == "response.create":
                if len(frame) <= INLINE_PARSE_BYTES:
                    self._queue(parse_request(event, RESPONSES_WEBSOCKET, self.config.limits))
                else:  # images: decoded on a worker thread, the other connections served meanwhile (in order here)
                    self._queue(await asyncio.to_thread(parse_request, event, RESPONSES_WEBSOCKET, self.config.limits))
            elif event["type"] == "response.cancel":
                self._cancel(check_stream_id(event.get("stream_id")))
            else:
                raise ProtocolError("unknown_event_type", f"unknown event type {shown(event['type'], 80)}; "
                                    "this server accepts response.create and response.cancel", "type")
        except ProtocolError as error:
            self._send_error(error, stream_id)

    def _queue(self, request: GenerationRequest) -> None:
        lane = self.lanes.get(request.stream_id)
        if lane is None and len(self.lanes) >= self.config.max_lanes:
            raise ProtocolError("too_many_streams", f"{len(self.lanes)} lanes (stream_id) are active on this "
                                f"connection, the most allowed; wait for one to finish", "stream_id", status=429)
        if self.num_waiting >= self.config.max_queued_requests:
            raise ProtocolError("too_many_queued_requests", f"{self.num_waiting} responses are already waiting "
                                "for their lanes on this connection; wait for some to finish", status=429)
        if lane is None:
            lane = self.lanes[request.stream_id] = Lane(request.stream_id)
            lane.task = asyncio.create_task(self._run_lane(lane))
        lane.waiting.append(request)

    async def _run_lane(self, lane: Lane) -> None:
        """Start the lane's responses one after another; the lane ends when none is left."""
        try:
            while lane.waiting:
                request = lane.waiting.popleft()
                lane.starting = True
                try:
                    stream = await self.responses.start(request, self.owner, self._on_update)
                except ProtocolError as error:
                    lane.cancel_on_start = False  # the cancel meant this one, which never ran
                    self._send_error(error, request.stream_id)
                    continue
                except Exception as exc:  # a bug: this request fails, with a reason; the lane goes on
                    log.exception("starting a response failed")
                    lane.cancel_on_start = False
                    self._send_error(ProtocolError("server_error", f"the response could not start: "
                                                   f"{type(exc).__name__}", error_type="server_error",
                                                   status=500), request.stream_id)
                    continue
                finally:
                    lane.starting = False
                lane.current, lane.done = stream, asyncio.Event()
                self.views.append(ResponsesEvents(stream))
                if self._shutting_down:  # it was being tokenized when the shutdown began
                    self.responses.shut_down(stream)
                elif lane.cancel_on_start:
                    lane.cancel_on_start = False
                    self.responses.cancel(stream)
                self._wake.set()
                await lane.done.wait()
                lane.current = None
        finally:
            if self.lanes.get(lane.stream_id) is lane:
                del self.lanes[lane.stream_id]

    def _on_update(self, stream: GenerationStream) -> None:
        """From the GenerationService: the stream has new events (and may have ended)."""
        self._wake.set()
        lane = self.lanes.get(stream.request.stream_id)
        if stream.is_done and lane is not None and lane.current is stream:
            lane.done.set()

    def _cancel(self, stream_id: str | None) -> None:
        lane = self.lanes.get(stream_id)
        if lane is not None and lane.current is not None and not lane.current.is_done:
            self.responses.cancel(lane.current)
        elif lane is not None and (lane.starting or lane.waiting):
            lane.cancel_on_start = True  # the response it means has not started yet
        else:
            raise ProtocolError("response_cancel_not_active", "there is no response in progress to cancel"
                                + ("" if stream_id is None else f" on stream {stream_id!r}"))

    def _abandon_all(self) -> None:
        """The connection is over: stop its responses, forget its store: false conversations."""
        for lane in list(self.lanes.values()):
            lane.waiting.clear()
            if lane.current is not None:
                self.responses.abandon(lane.current)
            if lane.task is not None:
                lane.task.cancel()  # one still tokenizing never submits
        self.responses.end_owner(self.owner)

    # ------------------------------------------------------------------ sending
    async def _wait_for_errors_taken(self) -> None:
        """Read no more from a client whose answers pile up, until it takes them, for a bounded time."""
        self._errors_taken.clear()
        try:
            await asyncio.wait_for(self._errors_taken.wait(), self.config.send_timeout_s)
        except asyncio.TimeoutError:
            raise ClientTooSlow(f"{len(self.errors)} error events wait for a client that does not read "
                                "them") from None

    def _send_error(self, error: ProtocolError, stream_id: str | None) -> None:
        # Unbounded only in appearance: the receive loop stops reading while this queue is full, and
        # each lane adds at most one error per request it holds.
        self.errors.append(error_event(error, stream_id))
        self._wake.set()

    async def _send_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._ending:
                return
            while self.errors:
                await self._send(self.errors.popleft())
                self._errors_taken.set()
            for view in list(self.views):
                for event in view.drain():
                    await self._send(event)
                if view.stream.is_done and not view.has_unsent_events:
                    self.views.remove(view)
            if self._shutting_down and not self.lanes and not self.views and not self.errors:
                return

    async def _send(self, event: dict[str, Any]) -> None:
        try:
            await asyncio.wait_for(self.connection.send(json.dumps(event)), self.config.send_timeout_s)
        except asyncio.TimeoutError:
            raise ClientTooSlow(f"the client took no frame for {self.config.send_timeout_s:g} s") from None

    async def _keepalive(self) -> None:
        """Ping now and then: a client that stops reading entirely is cut even when nothing is sent."""
        while not self._ending:
            await asyncio.sleep(self.config.keepalive_interval_s)
            try:
                await asyncio.wait_for(self._ping(), self.config.send_timeout_s)
            except asyncio.TimeoutError:
                raise ClientTooSlow(f"no answer to a ping for {self.config.send_timeout_s:g} s") from None

    async def _ping(self) -> None:
        await (await self.connection.ping())
