"""The conversations `previous_response_id` continues (server/generation/conversations.py) on their own: one LRU bounded
in conversations and in characters, each bound at its limit (all kept) and one past it (the least recently
used goes), a conversation larger than the whole budget not kept at all; `store: false` conversations
visible to their connection alone and dropped with it."""

from __future__ import annotations

from localserve.server.generation.conversations import ConversationStore


def said(text: str, reply: str | None = None) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}] + ([{"role": "assistant", "content": reply}] if reply else [])


def test_conversation_store_is_bounded_in_count_and_characters():
    store = ConversationStore(capacity=3, max_chars=10)
    for index in range(4):
        assert store.put(f"r{index}", [{"role": "user", "content": "ab"}])
    assert len(store) == 3 and store.get("r0", "c") is None
    assert store.get("r1", "c") == [{"role": "user", "content": "ab"}]  # r1 is now the most recent
    store.put("r4", [{"role": "user", "content": "x" * 7}])
    assert store.get("r2", "c") is None and store.get("r3", "c") is None and store.get("r1", "c") is not None
    assert store.num_chars == 9
    # a conversation larger than the whole budget is not kept, and evicts nothing
    assert not store.put("big", [{"role": "user", "content": "y" * 50}])
    assert store.get("big", "c") is None and len(store) == 2 and store.num_chars == 9
    # a store: false conversation is its connection's alone, and goes with it
    store.put("private", [{"role": "user", "content": "z"}], owner="c1")
    assert store.get("private", "c2") is None and store.get("private", "c1") is not None
    store.drop_owner("c1")
    assert store.get("private", "c1") is None and store.num_chars == 9




def test_capacity_conversations_are_kept_and_one_more_evicts_the_least_recently_used():
    store = ConversationStore(capacity=3, max_chars=1000)
    for response_id in ("r0", "r1", "r2"):
        assert store.put(response_id, said(response_id))
    assert len(store) == 3
    assert [store.get(response_id, "c") for response_id in ("r1", "r2", "r0")] == [said("r1"), said("r2"), said("r0")]
    assert store.put("r3", said("r3"))  # r1 is the least recently used now
    assert len(store) == 3 and store.get("r1", "c") is None
    assert all(store.get(response_id, "c") is not None for response_id in ("r0", "r2", "r3"))


def test_max_chars_are_kept_and_one_char_more_evicts_the_least_recently_used():
    store = ConversationStore(capacity=10, max_chars=10)
    store.put("r0", said("abcd"))
    store.put("r1", said("ef", reply="g"))  # every message's content counts, the roles do not
    store.put("r2", said("hij"))
    assert store.num_chars == 10 and len(store) == 3
    store.put("r3", said("k"))
    assert store.num_chars == 7 and len(store) == 3 and store.get("r0", "c") is None
    assert store.get("r1", "c") == said("ef", reply="g")


def test_a_conversation_of_the_whole_budget_is_kept_and_one_char_more_is_not():
    store = ConversationStore(capacity=10, max_chars=10)
    store.put("r0", said("a"))
    assert store.put("r1", said("x" * 10))  # the whole budget: everything else goes
    assert store.num_chars == 10 and len(store) == 1 and store.get("r0", "c") is None
    assert not store.put("r2", said("y" * 11))
    assert store.num_chars == 10 and len(store) == 1 and store.get("r1", "c") == said("x" * 10)


def test_a_store_false_conversation_is_its_connections_alone():
    store = ConversationStore(capacity=10, max_chars=100)
    store.put("shared", said("s"))
    store.put("mine", said("m"), owner="c1")
    assert store.get("shared", "c1") == store.get("shared", "c2") == said("s")
    assert store.get("mine", "c2") is None and store.get("mine", "c1") == said("m")
    got = store.get("mine", "c1")
    got.append({"role": "user", "content": "more"})  # the caller's copy: the store keeps its own
    assert store.get("mine", "c1") == said("m") and store.num_chars == 2


def test_a_refused_get_is_no_use_of_the_conversation():
    store = ConversationStore(capacity=2, max_chars=100)
    store.put("mine", said("m"), owner="c1")
    store.put("shared", said("s"))
    assert store.get("mine", "c2") is None  # another connection: mine stays the least recently used
    store.put("r0", said("r"))
    assert store.get("mine", "c1") is None and store.get("shared", "c1") == said("s")


def test_drop_owner_forgets_that_connections_conversations_only():
    store = ConversationStore(capacity=10, max_chars=100)
    store.put("mine", said("abc"), owner="c1")
    store.put("mine too", said("d"), owner="c1")
    store.put("theirs", said("ef"), owner="c2")
    store.put("shared", said("g"))
    store.drop_owner("c1")
    assert store.get("mine", "c1") is None and store.get("mine too", "c1") is None
    assert store.get("theirs", "c2") == said("ef") and store.get("shared", "c1") == said("g")
    assert len(store) == 2 and store.num_chars == 3
    store.drop_owner("c1")  # twice, or a connection that kept nothing: nothing happens
    store.drop_owner("nobody")
    assert len(store) == 2 and store.num_chars == 3


def test_a_conversation_the_lru_evicted_is_not_dropped_again_with_its_connection():
    store = ConversationStore(capacity=1, max_chars=100)
    store.put("mine", said("abc"), owner="c1")
    store.put("shared", said("de"))  # evicts mine
    store.drop_owner("c1")
    assert len(store) == 1 and store.num_chars == 2 and store.get("shared", "c1") == said("de")
