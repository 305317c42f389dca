"""The engine thread's reads once it has stopped (its model unloaded): answered at once with EngineStopped,
never left waiting (a read queued after the thread ended waited out the server's 30 s bound)."""

from __future__ import annotations

import pytest

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.engine_thread import EngineStopped, EngineThread
from localserve.engine.sampling_params import SamplingParams


@pytest.fixture
def engine_thread(tiny64):
    thread = EngineThread(build_engine(tiny64, None, EngineConfig(num_kv_blocks=16)))
    thread.start()
    yield thread
    thread.stop()


def test_reads_answer_while_running_and_fail_at_once_after_stop(engine_thread):
    assert engine_thread.stats().result(10).gauges.num_requests_running == 0
    engine_thread.stop()
    for future in (engine_thread.stats(), engine_thread.snapshot_and_events(0), engine_thread.call(len)):
        assert future.done()  # not queued for a thread that will never read it
        with pytest.raises(EngineStopped, match="the engine thread has stopped"):
            future.result(0)
    with pytest.raises(EngineStopped):
        engine_thread.submit([5, 6, 7], SamplingParams(max_tokens=2), lambda output: None)


def test_a_read_left_in_the_inbox_when_the_thread_ends_fails_then(engine_thread):
    engine_thread.stop()
    engine_thread._stopped = False  # as if the read had been queued just before the stop took effect
    late = engine_thread.stats()
    engine_thread.stop()
    with pytest.raises(EngineStopped):
        late.result(0)
