"""The engine on its own thread: requests in and token events out through thread-safe queues.

The asyncio server never touches torch; it submits requests with a callback, and the engine thread
calls that callback with each step's `RequestOutput` (the server hops back onto its loop with
`loop.call_soon_threadsafe`). Aborts are honoured before the next step, so blocks return at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from localserve.engine.engine import LLMEngine
from localserve.engine.outputs import RequestOutput
from localserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


class EngineThread:
    """Owns an LLMEngine and steps it on a dedicated thread while there is work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._ids = iter(range(1 << 62))
        self._id_lock = threading.Lock()
        self._running = False
        self._thread = threading.Thread(target=self._loop, name="localserve-engine", daemon=True)

    def start(self) -> None:
        self._running = True
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._running = False
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, on_output: OutputCallback,
               request_id: str | None = None) -> str:
        """Queue a request; raises ValueError at once if it can never run. Returns its id."""
        self.engine.validate(prompt_token_ids, params)  # reads only immutable settings: thread-safe
        if request_id is None:
            with self._id_lock:
                request_id = f"req-{next(self._ids)}"
        self._inbox.put(("add", request_id, list(prompt_token_ids), params, on_output))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step. Unknown ids are ignored."""
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) on the engine thread between steps (for snapshots and statistics)."""
        future: Future = Future()
        self._inbox.put(("call", fn, future))
        return future

    def _loop(self) -> None:
        while self._running:
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
            _, request_id, prompt, params, on_output = command
            try:
                self.engine.add_request(prompt, params, request_id)
                self._callbacks[request_id] = on_output
            except ValueError as exc:
                on_output(RequestOutput(request_id, prompt, [], True, error=str(exc)))
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
            # A failed step must not take the server down: fail what was running, free its blocks.
            log.exception("engine step failed; failing the running requests")
            for request_id in list(self.engine.requests):
                callback = self._callbacks.pop(request_id, None)
                request = self.engine.requests[request_id]
                self.engine.abort_request(request_id)
                if callback is not None:
                    callback(RequestOutput(request_id, request.prompt_token_ids, [], True,
                                           error=f"internal error: {type(exc).__name__}: {exc}"))
            return
        for output in outputs:
            callback = self._callbacks.get(output.request_id)
            if callback is None:
                continue
            if output.finished:
                del self._callbacks[output.request_id]
            try:
                callback(output)
            except Exception:
                log.exception("output callback for %s failed; aborting it", output.request_id)
                self._callbacks.pop(output.request_id, None)
                self.engine.abort_request(output.request_id)
