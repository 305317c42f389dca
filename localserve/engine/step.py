"""The step contract: what the scheduler decided for one engine step, in plain Python (no torch).

The scheduler fills a `StepInput`; the model runner turns it into tensors once, and every attention
backend builds its own metadata from those (localserve.attention.base.AttentionInputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localserve.engine.multimodal import MultiModalInputs


@dataclass(slots=True)
class SeqChunk:
    """One sequence's part of a step: `token_ids` are new tokens at positions start_pos, start_pos + 1, ...

    `block_table` is the block manager's own table of the sequence, not a copy (one per sequence per
    step would cost O(context) each): read it during the step, never change it, keep none past it.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]  # physical block of each logical block, covering at least context_len tokens
    needs_logits: bool = True  # False for a prefill chunk that does not reach the prompt's end
    # Names the sequence across steps, so the runner can keep its table and copy only what changed
    # (engine/block_tables.py); None: a one-off chunk whose table is copied whole.
    seq_id: int | None = None
    # A verify row of speculative decoding: its last `num_draft_tokens` tokens are a draft, and the logits of
    # each of them and of the token before are wanted (num_draft_tokens + 1 rows, in order).
    num_draft_tokens: int = 0
    # An embedding prompt's chunk: the runner returns its tokens' final hidden states (ModelRunner.execute_pooled).
    needs_hidden: bool = False
    # With layer groups (kv/layer_groups.py): the block manager's list of the sequence's tables, one per group
    # (group 0's is `block_table`), read like it; empty: one group.
    group_block_tables: Sequence[list[int]] = ()
    # Its request's images (engine/multimodal.py): the runner gives the model the embeddings of the chunk's tokens
    # inside a span instead of the tokens'. None: text only.
    multimodal: MultiModalInputs | None = None

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class StepInput:
    """Everything the model runner needs for one forward pass, block moves included.

    The logits come back one row per chunk with `needs_logits`, in chunk order: its last token's, or, for a
    verify row, its last `num_draft_tokens + 1` tokens'.

    The runner makes the block moves first, in this order: swap-out, swap-in, copy-on-write; then the
    forward pass writes into blocks those moves may just have freed or filled. The scheduler keeps the
    moves of one step independent of each other except for that order: the only block two of them name
    is a swap-out's source that the step hands out again (to a copy, a swap-in or a new prompt).
    """

    chunks: list[SeqChunk] = field(default_factory=list)
    # Each move names its layer group (kv/block_pool.py, BlockMove).
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)  # copy-on-write (source, destination, group)
    swap_out: list[tuple[int, int, int]] = field(default_factory=list)  # (gpu_block, cpu_block, group)
    swap_in: list[tuple[int, int, int]] = field(default_factory=list)  # (cpu_block, gpu_block, group)

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)
