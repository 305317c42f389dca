"""What the HTTP fuzzers share: running their generated cases, and the checks that the server came out whole."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.server import wait_until_idle


def send_generated_requests(fuzzer, requests: st.SearchStrategy, num_cases: int) -> None:
    """`num_cases` requests drawn from `requests`, each sent by `fuzzer.send(*request, drop_after)` (the
    client vanishing after 1-3 reads, or never), then the fuzzer's connection closed."""

    @settings(max_examples=num_cases, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(request=requests, drop_after=st.none() | st.integers(1, 3))
    def one_case(request, drop_after):
        fuzzer.send(*request, drop_after)

    one_case()
    fuzzer.reconnect()


def assert_server_whole(server) -> None:
    """The served model's engine idle with every block back (its integrity checked), its thread alive, and no
    HTTP exchange left in flight."""
    engine = server.server.models.serving_now().engine
    wait_until_idle(engine)
    assert engine._thread.is_alive()
    assert not server.server.http_api.in_flight
