"""One request never takes others down: a value that would break inside a step is refused at the edge;
an exception while serving one request fails that request alone (`response.failed`); the engine thread
survives a request it cannot even add, and a step that fails outside any request."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from websockets.asyncio.client import connect

from localserve.engine.engine_thread import EngineThread
from localserve.engine.sampling_params import SamplingParams
from tests.helpers.server import collect_response, running_server, wait_until_idle

STORY = "hello world tell me a story about the cat and the dog"


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def test_a_seed_out_of_torchs_range_fails_only_its_own_request(tiny_chat_llm):
    async def main(port: int) -> tuple[list[dict], list[dict], list[dict]]:
        url = f"ws://127.0.0.1:{port}/v1/responses"
        async with connect(url) as bystander, connect(url) as culprit, connect(url) as edge:
            await bystander.send(json.dumps({"type": "response.create", "input": STORY, "temperature": 0,
                                             "max_output_tokens": 200, "localserve": {"stop": "never said"}}))
            assert json.loads(await bystander.recv())["type"] == "response.created"
            # 2**64 - 1 is a valid seed; the second sample's seed (one more) is not
            await culprit.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 3,
                                           "localserve": {"seed": 2 ** 64 - 1, "n": 2}}))
            # the largest seeds allowed still run with 16 samples
            await edge.send(json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": 2,
                                        "localserve": {"seed": 2 ** 63 - 1, "n": 16}}))
            return (await collect_response(culprit), await collect_response(bystander),
                    await collect_response(edge))

    with running_server(tiny_chat_llm) as server:
        culprit, bystander, edge = run(main(server.port))
        wait_until_idle(server.server.models.serving_now().engine)
    assert culprit[-1]["type"] in ("error", "response.failed")
    assert bystander[-1]["type"] in ("response.completed", "response.incomplete"), bystander[-1]
    assert edge[-1]["type"] in ("response.completed", "response.incomplete"), edge[-1]
    assert len(edge[-1]["response"]["output"]) == 16


class ExplodingStopRules(SamplingParams):
    """Sampling parameters whose stop rules raise once `explode_after` tokens were checked against them."""

    explode_after = 3

    @property
    def stop_token_ids(self) -> list[int]:
        self.num_checks = getattr(self, "num_checks", 0) + 1
        if self.num_checks > self.explode_after:
            raise RuntimeError("a stop rule broke")
        return []

    @stop_token_ids.setter
    def stop_token_ids(self, value: list[int]) -> None:
        pass


class UnaddableParams(SamplingParams):
    """Sampling parameters that pass the server's checks but make adding the request raise."""

    @property
    def beam_search(self) -> bool:
        raise RuntimeError("cannot be added")

    @beam_search.setter
    def beam_search(self, value: bool) -> None:
        pass


class Collector:
    """Callbacks of the engine thread, one per request; `wait()` until all of them finished."""

    def __init__(self) -> None:
        self.finals: dict[str, object] = {}
        self._done = threading.Condition()

    def callback(self, name: str):
        def on_output(output) -> None:
            if output.finished:
                with self._done:
                    self.finals[name] = output
                    self._done.notify_all()
        return on_output

    def wait(self, names: set[str], timeout: float = 30) -> None:
        with self._done:
            assert self._done.wait_for(lambda: names <= set(self.finals), timeout), (names, set(self.finals))


@pytest.fixture()
def engine_thread(tiny_chat_llm):
    thread = EngineThread(tiny_chat_llm.engine)
    thread.start()
    yield thread
    wait_until_idle(thread)
    thread.stop()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_an_exception_serving_one_request_fails_it_alone(engine_thread):
    collector = Collector()
    prompt = list(range(10, 40))
    engine_thread.submit(prompt, greedy(40), collector.callback("bystander"))
    engine_thread.submit(prompt[:20], ExplodingStopRules(temperature=0, max_tokens=40, ignore_eos=True),
                         collector.callback("culprit"))
    collector.wait({"bystander", "culprit"})
    culprit, bystander = collector.finals["culprit"], collector.finals["bystander"]
    assert culprit.error and "a stop rule broke" in culprit.error
    assert bystander.error is None and len(bystander.outputs[0].token_ids) == 40


def test_the_engine_thread_survives_a_request_it_cannot_add(engine_thread):
    collector = Collector()
    engine_thread.submit(list(range(10, 30)), UnaddableParams(temperature=0, max_tokens=4),
                         collector.callback("culprit"))
    engine_thread.submit(list(range(10, 30)), greedy(4), collector.callback("after"))
    collector.wait({"culprit", "after"})
    assert "cannot be added" in collector.finals["culprit"].error
    assert collector.finals["after"].error is None and len(collector.finals["after"].outputs[0].token_ids) == 4


def test_a_step_that_fails_outside_any_request_fails_the_running_ones_and_the_thread_goes_on(engine_thread):
    collector = Collector()
    runner = engine_thread.engine.runner
    execute = runner.execute
    calls = iter(range(1 << 30))

    def execute_failing_once(step_input):
        if next(calls) == 2:
            raise RuntimeError("the device fell over")
        return execute(step_input)

    runner.execute = execute_failing_once
    try:
        engine_thread.submit(list(range(10, 30)), greedy(20), collector.callback("running"))
        collector.wait({"running"})
        engine_thread.submit(list(range(10, 30)), greedy(4), collector.callback("after"))
        collector.wait({"after"})
    finally:
        del runner.execute
    assert "the device fell over" in collector.finals["running"].error
    assert collector.finals["after"].error is None


def test_a_request_that_can_never_be_admitted_fails_instead_of_blocking_the_queue(tiny_model_dir):
    """The engine refuses at arrival a request that could never fit the pool; should one get past that
    (here: the check is skipped), the engine thread fails it as soon as a step schedules nothing while
    nothing holds the pool, instead of stepping empty batches with everyone behind it waiting for ever.
    (Before the scheduler's exact fit check, n samples preempted by recompute did exactly that: the load
    test lost turns.)"""
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from localserve.loading.hf import load_model

    folder, _ = tiny_model_dir("llama")
    engine = build_engine(load_model(folder).model, None, EngineConfig(num_kv_blocks=8, max_num_seqs=8,
                                                                  max_num_batched_tokens=64))
    too_long = list(range(3, 250)) + list(range(3, 13))  # 257 tokens: 17 blocks, the pool has 8
    with pytest.raises(ValueError, match="can never run"):
        engine.validate(too_long, greedy(4))
    validate = engine.validate
    thread = EngineThread(engine)
    thread.start()
    try:
        collector = Collector()
        engine.validate = lambda prompt, params, *rest: None  # on the engine thread too, until the end
        thread.submit(too_long, greedy(4), collector.callback("too long"))
        thread.submit(list(range(70, 80)), greedy(8), collector.callback("behind"))
        collector.wait({"too long", "behind"}, timeout=60)
        wait_until_idle(thread)
    finally:
        engine.validate = validate
        thread.stop()
    assert "can never be admitted" in collector.finals["too long"].error
    assert collector.finals["behind"].error is None and len(collector.finals["behind"].outputs[0].token_ids) == 8
