"""The scheduler's queues of requests, one per state, each in arrival order. No torch."""

from __future__ import annotations

import bisect
import operator

from localserve.engine.sequence import Request, RequestState

_arrival = operator.attrgetter("arrival")


class RequestQueues:
    """The waiting requests (new, or preempted by recompute: they hold no blocks), the running ones (they
    hold GPU blocks) and the swapped ones (preempted by swap: their blocks sit in the CPU pool), each list
    in arrival order. A request's state names its queue; `move` changes the two together."""

    def __init__(self) -> None:
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []

    def add(self, request: Request) -> None:
        """A new request waits. It arrived after every request queued so far, so it goes last."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def next_to_admit(self) -> Request | None:
        """The oldest queued request: the swapped and waiting queues are served as one, in arrival order."""
        swapped, waiting = self.swapped, self.waiting
        if swapped and (not waiting or swapped[0].arrival < waiting[0].arrival):
            return swapped[0]
        return waiting[0] if waiting else None

    def move(self, request: Request, state: RequestState) -> None:
        """Take the request out of its state's queue and put it into `state`'s, in arrival order; a
        finished request is in no queue."""
        queue = self._queue(request.state)
        if queue is not None:
            index = bisect.bisect_left(queue, request.arrival, key=_arrival)  # no O(N) search by identity
            if index == len(queue) or queue[index] is not request:
                index = queue.index(request)  # another request of the same arrival comes first
            del queue[index]
        request.state = state
        if state is RequestState.RUNNING:
            bisect.insort_right(self.running, request, key=_arrival)  # after any of the same arrival
        elif (queue := self._queue(state)) is not None:
            bisect.insort_left(queue, request, key=_arrival)  # before any of the same arrival

    def _queue(self, state: RequestState) -> list[Request] | None:
        if state is RequestState.RUNNING:
            return self.running
        if state is RequestState.WAITING:
            return self.waiting
        if state is RequestState.SWAPPED:
            return self.swapped
        return None
