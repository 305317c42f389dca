"""Prompt lookup: a draft made of the tokens that followed an earlier occurrence of the sequence's last few
tokens, in its prompt or its output (vLLM's "ngram" method, llama.cpp's n-gram drafts). No model, no
torch: it wins where a reply repeats what it was given (code being edited, a document being quoted,
structured text) and proposes nothing elsewhere.

The longest suffix of `MAX_NGRAM` down to `MIN_NGRAM` tokens that occurred before is looked up, and its
latest earlier occurrence wins (the text being copied is usually the nearest). Each sequence keeps an
index from every n-gram of its tokens to where the latest occurrence ended, extended by the tokens added
since the last query: a query costs O(new tokens), not O(sequence).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from localserve.engine.drafting import Draft, DraftQuery

MIN_NGRAM, MAX_NGRAM = 2, 4  # one-token matches propose mostly noise in free text


@dataclass(slots=True)
class NgramIndex:
    """One sequence's n-grams -> the position right after their latest occurrence, over its first
    `num_indexed` positions (an n-gram is indexed once a token follows it)."""

    by_length: dict[int, dict[tuple[int, ...], int]] = field(
        default_factory=lambda: {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)})
    num_indexed: int = 0

    def extend(self, tokens: SequenceABC[int], end: int) -> None:
        """Index the n-grams followed by a token at positions up to `end` - 1."""
        for position in range(max(self.num_indexed, MIN_NGRAM), end):
            for n, table in self.by_length.items():
                if position >= n:
                    table[tuple(tokens[position - n:position])] = position
        self.num_indexed = max(self.num_indexed, end)

    def lookup(self, tokens: SequenceABC[int], num_tokens: int, max_tokens: int) -> list[int]:
        """The tokens after the latest earlier occurrence of the longest indexed suffix of tokens[:num_tokens]."""
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if num_tokens < n:
                continue
            follows = self.by_length[n].get(tuple(tokens[num_tokens - n:num_tokens]))
            if follows is not None:
                return list(tokens[follows:min(follows + max_tokens, num_tokens)])
        return []


class NgramDrafter:
    """The `Drafter` of prompt lookup (module doc); its drafts are point masses."""

    def __init__(self) -> None:
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, queries: list[DraftQuery]) -> list[Draft]:
        drafts = []
        for query in queries:
            index = self._indexes.get(query.seq_id)
            if index is None:
                index = self._indexes[query.seq_id] = NgramIndex()
            tokens, num_tokens = query.token_ids, len(query.token_ids)
            # Up to the last position: the suffix itself, followed by nothing yet, is not its own match.
            index.extend(tokens, num_tokens)
            drafts.append(Draft(index.lookup(tokens, num_tokens, query.max_tokens)))
        return drafts

    def release(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)
