"""Followers: the samples or beams of a request readmitted after a preemption by recompute that share
their leader's first blocks before the leader has computed them (`BlockManager.allocate_sharing`).

The leader computes the blocks of their common prefix once; each follower counts them as computed as the
leader gets there, and is not scheduled before (`awaits_leader`). This part keeps who follows whom and how
far; the block manager keeps the blocks, and applies what `catch_up` says to its sequences' books.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class FollowerLink:
    """A follower shares its leader's first `num_shared_blocks` blocks and waits for the leader to compute them."""

    leader_id: int
    num_shared_blocks: int


class Followers:
    """Who follows whom, by sequence id, until each follower has all its shared blocks computed."""

    __slots__ = ("_links", "_by_leader")

    def __init__(self) -> None:
        self._links: dict[int, FollowerLink] = {}  # follower id -> its link
        self._by_leader: dict[int, list[int]] = {}  # leader id -> its followers, never empty

    @property
    def links(self) -> Mapping[int, FollowerLink]:
        """Every follower's link, by follower id (read-only)."""
        return MappingProxyType(self._links)

    def add(self, follower_id: int, leader_id: int, num_shared_blocks: int) -> None:
        """Make `follower_id` wait for `leader_id` to compute their first `num_shared_blocks` blocks."""
        self._links[follower_id] = FollowerLink(leader_id, num_shared_blocks)
        self._by_leader.setdefault(leader_id, []).append(follower_id)

    def awaits_leader(self, seq_id: int) -> bool:
        """True while the sequence shares blocks its leader has not computed yet."""
        return seq_id in self._links

    def leads(self, seq_id: int) -> bool:
        """True while the sequence has followers waiting for it."""
        return seq_id in self._by_leader

    def catch_up(self, leader_id: int, num_computed_blocks: int) -> list[tuple[int, int]]:
        """The leader has computed its first `num_computed_blocks` blocks: returns, for each of its
        followers, (follower id, shared blocks it now has computed). A follower that has them all stops
        following."""
        caught_up = []
        still_waiting = []
        for follower_id in self._by_leader[leader_id]:
            num_shared_blocks = self._links[follower_id].num_shared_blocks
            caught_up.append((follower_id, min(num_computed_blocks, num_shared_blocks)))
            if num_computed_blocks < num_shared_blocks:
                still_waiting.append(follower_id)
            else:
                del self._links[follower_id]
        if still_waiting:
            self._by_leader[leader_id] = still_waiting
        else:
            del self._by_leader[leader_id]
        return caught_up

    def forget(self, seq_id: int) -> None:
        """The sequence is gone: it follows no one, and its own followers compute their blocks themselves."""
        link = self._links.pop(seq_id, None)
        if link is not None:
            followers = self._by_leader[link.leader_id]
            followers.remove(seq_id)
            if not followers:
                del self._by_leader[link.leader_id]
        for follower_id in self._by_leader.pop(seq_id, ()):
            del self._links[follower_id]

    def check_integrity(self) -> None:
        """Raise AssertionError unless each follower is listed under its leader, and only there."""
        listed = {follower_id: leader_id for leader_id, followers in self._by_leader.items()
                  for follower_id in followers}
        linked = {follower_id: link.leader_id for follower_id, link in self._links.items()}
        # Not `assert`: the checks must also run under `python -O`.
        if listed != linked or any(not followers for followers in self._by_leader.values()) \
                or sum(map(len, self._by_leader.values())) != len(listed):
            raise AssertionError(f"followers by leader {self._by_leader} disagree with the links {linked}")
