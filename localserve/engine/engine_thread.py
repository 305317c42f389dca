"""The engine on its own thread: requests in and token events out through thread-safe queues.

The asyncio server never touches torch or the engine: it reads the engine's fixed `facts`, submits
requests with a callback, aborts them, and asks for statistics, snapshots and events, each read on
this thread between two steps (`stats`, `snapshot_and_events`). The engine thread calls a request's
callback with each step's `RequestOutput` (the server hops back onto its loop with
`loop.call_soon_threadsafe`). Aborts are honoured before the next step, so blocks return at once.

The thread survives anything: a request that cannot be added fails alone; an exception while serving
one request fails that request (the engine's guard); a step that fails outside any guard fails the
requests it may have left half done; a request that can never be admitted (while nothing else holds
the pool) fails instead of blocking the queue; a callback that raises is logged and its request aborted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from localserve.engine.embedding_params import EmbeddingParams
from localserve.engine.engine import LLMEngine
from localserve.engine.events import EngineEvent
from localserve.engine.facts import EngineFacts, read_facts
from localserve.engine.multimodal import MultiModalInputs
from localserve.engine.outputs import RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.snapshot import EngineSnapshot, EngineStats

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


class EngineStopped(RuntimeError):
    """The engine thread has stopped (its model was unloaded, or the server is closing): a read or a request
    asked of it now is refused at once instead of waiting for a thread that will never answer."""


class EngineThread:
    """Owns an LLMEngine and steps it on a dedicated thread while there is work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # the owner's (tests, tools); the server uses the methods below
        self.facts: EngineFacts = read_facts(engine)
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._ids = iter(range(1 << 62))
        self._id_lock = threading.Lock()
        self._running = False
        self._stopped = False  # stop() was called: nothing more is queued (under _inbox_lock)
        self._inbox_lock = threading.Lock()
        self._consecutive_failures = 0  # steps in a row that raised outside any one request
        self._thread = threading.Thread(target=self._loop, name="localserve-engine", daemon=True)

    def start(self) -> None:
        self._running = True
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread after the step under way. What was queued and not handled by then (a read put while
        the last step ran) fails with EngineStopped, as does anything asked afterwards."""
        with self._inbox_lock:
            self._stopped = True
            self._running = False
            self._inbox.put(("wake",))
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._refuse_queued()

    def _refuse_queued(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "call":
                command[2].set_exception(EngineStopped("the engine thread has stopped"))
            elif command[0] == "add":
                _, request_id, prompt, _, on_output = command
                self._deliver(on_output, RequestOutput(request_id, prompt, [], True,
                                                       error="the engine thread has stopped"))

    def _put(self, command: tuple[Any, ...]) -> None:
        with self._inbox_lock:
            if self._stopped:
                raise EngineStopped("the engine thread has stopped")
            self._inbox.put(command)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | EmbeddingParams, on_output: OutputCallback,
               request_id: str | None = None, multimodal: MultiModalInputs | None = None) -> str:
        """Queue a request (with EmbeddingParams an embedding request, whose one output is its final one,
        holding the vector; with `multimodal`, its images: LLMEngine.add_request); raises ValueError at once
        if it can never run, EngineStopped once the thread has stopped. Returns its id. A callable making
        image embeddings is called on the engine thread."""
        if self._stopped:
            raise EngineStopped("the engine thread has stopped")
        self.engine.validate(prompt_token_ids, params, multimodal)  # reads only immutable settings: thread-safe
        if request_id is None:
            with self._id_lock:
                request_id = f"req-{next(self._ids)}"
        self._put(("add", request_id, list(prompt_token_ids), params, on_output, multimodal))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step. Unknown ids are ignored (and, once the
        thread has stopped, every id: nothing holds a block any more)."""
        with self._inbox_lock:
            if not self._stopped:
                self._inbox.put(("abort", request_id))

    def stats(self) -> Future[EngineStats]:
        """The engine's gauges and counters, read between two steps."""
        return self.call(lambda engine: engine.stats())

    def snapshot_and_events(self, after_seq: int) -> Future[tuple[EngineSnapshot, list[EngineEvent], int]]:
        """A snapshot, the events numbered above `after_seq` and how many of those the log no longer
        holds, read together between two steps (the events are those up to the snapshot)."""
        return self.call(lambda engine: (engine.snapshot(), *engine.events.since(after_seq)))

    @property
    def last_event_seq(self) -> int:
        """The number of the engine's latest event (the event log is thread-safe)."""
        return self.engine.events.last_seq

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) on the engine thread between steps and give its result (for tests and tools;
        the server reads through the methods above)."""
        future: Future = Future()
        try:
            self._put(("call", fn, future))
        except EngineStopped as stopped:
            future.set_exception(stopped)
        return future

    def _loop(self) -> None:
        while self._running:
            try:
                self._turn()
            except Exception:  # a bug outside any one request: log it, keep serving
                log.exception("engine thread: unexpected error; going on")

    def _turn(self) -> None:
        # Block while idle; otherwise take whatever arrived and step.
        self._handle(self._inbox.get() if not self.engine.has_unfinished_requests() else None)
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                break
        if self._running and self.engine.has_unfinished_requests():
            self._step()

    def _handle(self, command: tuple[Any, ...] | None) -> None:
        if command is None:
            return
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, on_output, multimodal = command
            try:
                self.engine.add_request(prompt, params, request_id, multimodal)
                self._callbacks[request_id] = on_output
            except Exception as exc:  # only this request is refused, whatever went wrong
                if not isinstance(exc, ValueError):
                    log.exception("adding request %s failed", request_id)
                self._deliver(on_output, RequestOutput(request_id, prompt, [], True, error=_reason(exc)))
        elif kind == "abort":
            self._callbacks.pop(command[1], None)
            self.engine.abort_request(command[1])
        elif kind == "call":
            _, fn, future = command
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # the caller gets the error; the engine goes on
                future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._recover(exc)
            return
        self._consecutive_failures = 0
        if self._stalled():
            self._fail_unschedulable()
        for output in outputs:
            callback = self._callbacks.get(output.request_id)
            if callback is None:
                continue
            if output.finished:
                del self._callbacks[output.request_id]
            if not self._deliver(callback, output):
                self._callbacks.pop(output.request_id, None)
                self.engine.abort_request(output.request_id)

    def _recover(self, exc: Exception) -> None:
        """A step raised outside any one request's guard: fail the requests it may have left half done.

        Those are the running ones. If the next step fails too, the cause may sit with a request that
        was not running (waiting or swapped): then every request fails, so the engine makes progress.
        """
        self._consecutive_failures += 1
        everyone = self._consecutive_failures > 1
        log.exception("engine step failed; failing the %s requests", "unfinished" if everyone else "running",
                      exc_info=exc)
        engine = self.engine
        suspects = list(engine.requests) if everyone else [r.request_id for r in engine.scheduler.queues.running]
        for request_id in suspects:
            request = engine.requests.get(request_id)
            engine.fail_request(request_id, _reason(exc))
            callback = self._callbacks.pop(request_id, None)
            if callback is not None and request is not None:
                self._deliver(callback, RequestOutput(request_id, request.prompt_token_ids, [], True,
                                                      error=_reason(exc)))

    def _stalled(self) -> bool:
        """The step ran nothing while nothing holds the pool, yet requests wait: the first of them (n
        samples after a preemption, say) can never be admitted, and everyone behind it would wait forever."""
        engine, queues = self.engine, self.engine.scheduler.queues
        return bool(engine.step_history and engine.step_history[-1].num_tokens == 0 and queues.waiting
                    and not queues.running and not queues.swapped)

    def _fail_unschedulable(self) -> None:
        engine = self.engine
        request = engine.scheduler.queues.waiting[0]
        reason = (f"this request can never be admitted: no other request holds the KV pool "
                  f"({engine.block_manager.num_blocks} blocks), and it still does not fit")
        log.warning("request %s failed: %s", request.request_id, reason)
        engine.fail_request(request.request_id, reason)
        callback = self._callbacks.pop(request.request_id, None)
        if callback is not None:
            self._deliver(callback, RequestOutput(request.request_id, request.prompt_token_ids, [], True,
                                                  error=reason))

    @staticmethod
    def _deliver(callback: OutputCallback, output: RequestOutput) -> bool:
        """Hand an output to its callback; a callback that raises is logged, never propagated."""
        try:
            callback(output)
            return True
        except Exception:
            log.exception("output callback for %s failed", output.request_id)
            return False


def _reason(exc: Exception) -> str:
    """What a client is told: a refusal's own message, or the kind of internal error."""
    return str(exc) if isinstance(exc, ValueError) else f"internal error: {type(exc).__name__}: {exc}"
