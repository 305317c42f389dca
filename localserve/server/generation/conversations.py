"""The conversations `previous_response_id` continues: server-wide for stored responses, per connection
for `store: false` ones.

A response's conversation (the messages of every turn and its reply) is kept under its id. A stored
response (`store` true, the default) can be continued from any connection; a `store: false` one
belongs to the connection that made it: any other connection gets `previous_response_not_found`, and
it is dropped when that connection closes. One LRU, bounded in conversations and in characters, holds
both kinds; a conversation larger than the whole character budget is not kept at all. The images a
conversation keeps (server/generation/image_prompt.py) count by their files' bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from localserve.server.request.generation_request import STORED_IMAGES, Message, message_chars

Messages = list[Message]


@dataclass
class _Entry:
    messages: Messages
    num_chars: int
    owner: str | None  # the connection a store: false response belongs to; None when stored


def image_bytes(messages: Messages) -> int:
    """The bytes of the image files the messages keep (counted against the store's characters alike)."""
    return sum(len(image.data) for message in messages for _, image in message.get(STORED_IMAGES, ()))


class ConversationStore:
    """Conversations by response id, least recently used evicted first."""

    def __init__(self, capacity: int, max_chars: int) -> None:
        self.capacity, self.max_chars = capacity, max_chars
        self.num_chars = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._by_owner: dict[str, set[str]] = {}

    def get(self, response_id: str, owner: str) -> Messages | None:
        """A copy of the conversation ending with `response_id`'s reply, if `owner` may continue it."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner not in (None, owner):
            return None
        self._entries.move_to_end(response_id)
        return list(entry.messages)

    def put(self, response_id: str, messages: Messages, owner: str | None = None) -> bool:
        """Keep a conversation (`owner`: the connection of a store: false response); False if too large."""
        num_chars = sum(message_chars(message) for message in messages) + image_bytes(messages)
        if num_chars > self.max_chars:
            return False
        self._entries[response_id] = _Entry(messages, num_chars, owner)
        self.num_chars += num_chars
        if owner is not None:
            self._by_owner.setdefault(owner, set()).add(response_id)
        while len(self._entries) > self.capacity or self.num_chars > self.max_chars:
            self._remove(next(iter(self._entries)))
        return True

    def drop_owner(self, owner: str) -> None:
        """Forget the store: false conversations of a connection that closed."""
        for response_id in list(self._by_owner.get(owner, ())):
            self._remove(response_id)
        self._by_owner.pop(owner, None)

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        self.num_chars -= entry.num_chars
        if entry.owner is not None:
            owned = self._by_owner.get(entry.owner)
            if owned is not None:
                owned.discard(response_id)
                if not owned:
                    del self._by_owner[entry.owner]

    def __len__(self) -> int:
        return len(self._entries)
