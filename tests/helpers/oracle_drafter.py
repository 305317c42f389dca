"""A drafter for tests that knows each sequence's greedy continuation and drafts it with planted mistakes, so
a test decides how much of every draft is kept: whole drafts, drafts cut at any place, drafts rejected at
their first token. The verification over the model is the real one; only the proposals are made up."""

from __future__ import annotations

import random
from collections.abc import Callable

from localserve.engine.drafting import Draft, DraftQuery


class OracleDrafter:
    """Drafts what follows a sequence's tokens in one of `expected` (whole token lists: prompt and greedy
    output), each drafted token replaced by another with chance `wrong` (seeded): after a wrong token the
    rest of the draft is rejected too. A sequence whose tokens no expected list starts with drafts what
    `guess(tokens, k)` says (a reference model's greedy tokens, say), or nothing without it."""

    def __init__(self, expected: list[list[int]], vocab_size: int, wrong: float = 0.3, seed: int = 0,
                 guess: Callable[[list[int], int], list[int]] | None = None) -> None:
        self.expected = expected
        self.guess = guess
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.rng = random.Random(seed)
        self.num_planted = 0  # wrong tokens drafted

    def propose(self, queries: list[DraftQuery]) -> list[Draft]:
        drafts = []
        for query in queries:
            tokens = list(query.token_ids)
            full = next((whole for whole in self.expected if whole[:len(tokens)] == tokens), None)
            if full is not None:
                follow = full[len(tokens):len(tokens) + query.max_tokens]
            else:
                follow = self.guess(tokens, query.max_tokens) if self.guess is not None else []
            draft = []
            for token in follow:
                if self.rng.random() < self.wrong:
                    token = (token + self.rng.randrange(1, self.vocab_size)) % self.vocab_size
                    self.num_planted += 1
                draft.append(token)
            drafts.append(Draft(draft))
        return drafts

    def release(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""
