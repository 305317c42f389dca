"""The engine thread as the server sees it: `EngineAccess` is all the server reads of an engine (its fixed
facts, submitting and aborting, and statistics, snapshots and events read on the engine thread between
steps). Each loaded model has its own engine thread (server/registry/registry.py lends them out).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar

from localserve.engine.embedding_params import EmbeddingParams
from localserve.engine.events import EngineEvent
from localserve.engine.facts import EngineFacts
from localserve.engine.outputs import RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.snapshot import EngineSnapshot, EngineStats

T = TypeVar("T")
ENGINE_CALL_TIMEOUT_S = 30.0  # a snapshot or statistics call on the engine thread never takes longer


class EngineAccess(Protocol):
    """What the server uses of the engine thread (localserve.engine.engine_thread.EngineThread)."""

    facts: EngineFacts

    @property
    def last_event_seq(self) -> int:
        """The number of the engine's latest event."""

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | EmbeddingParams,
               on_output: Callable[[RequestOutput], None], request_id: str | None = None) -> str:
        """Queue a request (an embedding request with EmbeddingParams); raises ValueError at once if it can
        never run. A request with images also passes `multimodal=` (engine/multimodal.py's MultiModalInputs):
        only then, so a test's engine may leave the keyword out."""

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step."""

    def stats(self) -> Future[EngineStats]:
        """The engine's gauges and counters, read between two steps."""

    def snapshot_and_events(self, after_seq: int) -> Future[tuple[EngineSnapshot, list[EngineEvent], int]]:
        """A snapshot, the events after `after_seq` and how many of those are gone, read together."""


def on_event_loop(loop: asyncio.AbstractEventLoop, handle: Callable[[RequestOutput], None]
                  ) -> Callable[[RequestOutput], None]:
    """An engine thread's output callback that runs `handle(output)` on `loop`. Once the loop is closed
    (the server has stopped; the engine thread stops after it) an output has nobody to go to and is
    dropped: a step under way when the server closed, a stopped response's final output."""
    def post(output: RequestOutput) -> None:
        try:
            loop.call_soon_threadsafe(handle, output)
        except RuntimeError:  # closed, checked under the loop's own rules (no race with is_closed())
            if not loop.is_closed():
                raise
    return post


async def engine_result(future: Future[T]) -> T:
    """The result of a read the engine thread makes between two steps, waited for a bounded time."""
    return await asyncio.wait_for(asyncio.wrap_future(future), ENGINE_CALL_TIMEOUT_S)
