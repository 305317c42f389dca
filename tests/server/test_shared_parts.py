"""What the server's parts share (once server/context.py), on their own: which hosts count as this machine
alone (near misses included) and the refusal to listen beyond it without a key (server/wire/access.py);
closing a websocket within a bound (server/wire/closing.py); reading an engine-thread future and posting its
outputs to the loop (server/registry/engine_access.py); a served model (server/registry/served_model.py).
(The names a model answers to: tests/server/registry/test_model_registry.py.)"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from localserve.engine.outputs import RequestOutput
from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.config import ServerConfig
from localserve.server.registry.engine_access import engine_result, on_event_loop
from localserve.server.registry.served_model import ServedModel
from localserve.server.request.validation import ProtocolError
from localserve.server.wire.access import check_bind_safety, is_loopback
from localserve.server.wire.closing import close_within

LOOPBACK = ["localhost", "127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "[::1]", "0:0:0:0:0:0:0:1"]
NOT_LOOPBACK = [
    "0.0.0.0", "::", "[::]", "", "192.168.1.10", "128.0.0.1", "126.255.255.255",  # all interfaces, or another machine
    "127.0.0.1.evil", "localhost.evil", "evil.localhost", "127.0.0.1.", "localhost.",  # a name that merely begins so
    "LOCALHOST", " localhost", "localhost ", "127.0.0.1 ", "127.1", "0177.0.0.1", "2130706433",  # spelled otherwise
    "::ffff:127.0.0.1", "[::ffff:127.0.0.1]", "::2", "::1:0",  # IPv6 near misses
]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_hosts(host):
    assert is_loopback(host)
    check_bind_safety(ServerConfig(host=host))  # no key needed


@pytest.mark.parametrize("host", NOT_LOOPBACK)
def test_near_misses_are_not_loopback_and_need_a_key(host):
    """A spelling the resolver might take for this machine is still refused: listening beyond loopback
    without a key is the one mistake here that cannot be taken back. An IPv4-mapped address cannot even
    be bound (asyncio binds IPv6 sockets IPv6-only), though Python 3.13's ipaddress calls it loopback."""
    assert not is_loopback(host)
    with pytest.raises(ValueError) as raised:
        check_bind_safety(ServerConfig(host=host))
    assert f"refusing to listen on {host}" in str(raised.value) and "--api-key" in str(raised.value)
    check_bind_safety(ServerConfig(host=host, api_key="k"))  # with a key it may


def test_an_empty_key_is_no_key():
    with pytest.raises(ValueError, match="--api-key"):
        check_bind_safety(ServerConfig(host="0.0.0.0", api_key=""))


class Closing:
    """A websocket connection whose closing handshake the client answers after `answer_s` (None: never)."""

    def __init__(self, answer_s: float | None) -> None:
        self.answer_s = answer_s
        self.closed_with: tuple[int, str] | None = None
        self.aborted = False
        self.transport = self

    async def close(self, code: int, reason: str) -> None:
        self.closed_with = (code, reason)
        await asyncio.sleep(self.answer_s if self.answer_s is not None else 3600)

    def abort(self) -> None:
        self.aborted = True


def test_a_close_the_client_answers_in_time_is_a_close_and_one_it_does_not_is_a_reset():
    answered, unanswered = Closing(answer_s=0.01), Closing(answer_s=None)

    async def close_both() -> None:
        await asyncio.gather(close_within(answered, 1001, "bye", timeout_s=0.5),
                             close_within(unanswered, 1008, "slow", timeout_s=0.2))

    asyncio.run(asyncio.wait_for(close_both(), 5))  # returns: the unanswered close does not hold it
    assert answered.closed_with == (1001, "bye") and not answered.aborted
    assert unanswered.closed_with == (1008, "slow") and unanswered.aborted


def test_engine_result_gives_what_the_engine_thread_set():
    async def read(value=None, error=None):
        future: Future = Future()
        thread = threading.Timer(0.02, lambda: future.set_exception(error) if error else future.set_result(value))
        thread.start()
        try:
            return await engine_result(future)
        finally:
            thread.join()

    assert asyncio.run(read(value=("snapshot", 3))) == ("snapshot", 3)
    with pytest.raises(KeyError, match="gone"):
        asyncio.run(read(error=KeyError("gone")))


def test_an_embedding_model_says_so_and_refuses_text():
    defaults = SamplingDefaults(0.5, source="test")
    model = ServedModel("embed", 512, defaults, is_embedding=True)
    assert model.capabilities == ["embedding"]
    with pytest.raises(ProtocolError) as raised:
        model.check_generates()
    assert (raised.value.code, raised.value.param, raised.value.status) == ("model_not_generative", "model", 400)
    generation = ServedModel("alias", 512, defaults)
    generation.check_generates()
    assert generation.capabilities == ["completion"]


def test_an_output_posted_to_the_event_loop_runs_there_and_one_after_it_closed_is_dropped():
    loop = asyncio.new_event_loop()
    handled = []
    post = on_event_loop(loop, lambda output: handled.append((output.request_id, threading.get_ident())))
    output = RequestOutput("r1", [1], [], True)
    post(output)
    loop.run_until_complete(asyncio.sleep(0))
    assert handled == [("r1", threading.get_ident())]
    loop.close()
    post(RequestOutput("r2", [1], [], True))  # the server has stopped: nothing raised, nothing run
    assert [request_id for request_id, _ in handled] == ["r1"]
