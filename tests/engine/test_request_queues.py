"""The scheduler's queues: each in arrival order, a request's state naming its queue."""

from __future__ import annotations

from localserve.engine.request_queues import RequestQueues
from localserve.engine.sequence import RequestState
from tests.helpers.scheduler_states import make_request


def queued() -> tuple[RequestQueues, list]:
    queues = RequestQueues()
    requests = [make_request(arrival, [3, 4], [[]]) for arrival in range(5)]
    for request in requests:
        queues.add(request)
    return queues, requests


def test_a_move_puts_the_request_in_its_new_states_queue_in_arrival_order():
    queues, (r0, r1, r2, r3, r4) = queued()
    for request in (r3, r0, r2):
        queues.move(request, RequestState.RUNNING)
    assert queues.running == [r0, r2, r3] and queues.waiting == [r1, r4]
    queues.move(r2, RequestState.WAITING)  # preempted by recompute: back ahead of the newer r4
    queues.move(r3, RequestState.SWAPPED)
    assert queues.running == [r0] and queues.waiting == [r1, r2, r4] and queues.swapped == [r3]
    assert (r2.state, r3.state) == (RequestState.WAITING, RequestState.SWAPPED)


def test_a_finished_request_leaves_every_queue():
    queues, (r0, r1, r2, r3, r4) = queued()
    queues.move(r1, RequestState.RUNNING)
    queues.move(r2, RequestState.RUNNING)
    queues.move(r2, RequestState.SWAPPED)
    for request in (r1, r2, r3):
        queues.move(request, RequestState.FINISHED)
        assert request.state is RequestState.FINISHED
    assert (queues.waiting, queues.running, queues.swapped) == ([r0, r4], [], [])
    assert queues.has_work()
    queues.move(r0, RequestState.FINISHED)
    queues.move(r4, RequestState.FINISHED)
    assert not queues.has_work()


def test_the_next_to_admit_is_the_earlier_head_of_the_swapped_and_waiting_queues():
    queues, (r0, r1, r2, r3, r4) = queued()
    assert queues.next_to_admit() is r0
    for request in (r0, r1, r2):
        queues.move(request, RequestState.RUNNING)
    queues.move(r1, RequestState.SWAPPED)
    assert queues.next_to_admit() is r1  # swapped, and it arrived before r3, the waiting head
    queues.move(r1, RequestState.RUNNING)
    queues.move(r2, RequestState.SWAPPED)
    queues.move(r3, RequestState.RUNNING)
    assert queues.next_to_admit() is r2
    queues.move(r2, RequestState.FINISHED)
    assert queues.next_to_admit() is r4
    queues.move(r4, RequestState.FINISHED)
    assert queues.next_to_admit() is None
