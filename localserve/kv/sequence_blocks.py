"""What the block manager (kv/block_manager.py) knows of one sequence: its record, `SequenceBlocks`.

Its read-only view is `block_books.SequenceView`; only the manager changes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from localserve.kv.block_hash import ROOT_HASH, BlockContent, block_extra_key, block_payload


@dataclass(slots=True, eq=False)
class SequenceBlocks:
    """What the block manager knows of one sequence."""

    # Its own copy, or (`share_token_ids`) the caller's list, which may run a pending token ahead of `num_tokens`.
    token_ids: list[int]
    # Per group: GPU block ids (NO_BLOCK where a window group gave the block back or a state group holds no
    # slot), or CPU block ids while swapped out. The outer list stays the sequence's for its life; an inner
    # one may be replaced.
    block_tables: list[list[int]]
    num_computed_tokens: int
    block_hashes: list[bytes]  # keys of the full computed blocks (with prefix caching only)
    extra_key: bytes
    num_tokens: int  # tokens the manager has of token_ids
    num_prompt_tokens: int = 0  # its prompt's, where the state group's last checkpoint of the prompt lies
    shares_token_ids: bool = False
    is_swapped: bool = False
    # Set by `fork`, the one operation sharing a block that is not full: an append reads the last block's
    # count only then. Clear: the last block, if partly filled, is the sequence's own.
    may_share_last_block: bool = False
    # Per block (index): its own extra key besides `extra_key` (block_hash.block_extra_key), e.g. the content
    # of the image whose tokens it covers; none past the end.
    block_extra_keys: tuple[bytes, ...] = ()

    def block_payload(self, index: int, block_size: int) -> BlockContent:
        """What the key of its block `index` is the hash of: the previous block's key, its extra key, its tokens."""
        parent_hash = self.block_hashes[index - 1] if index else ROOT_HASH
        return block_payload(parent_hash, self.token_ids[index * block_size:(index + 1) * block_size],
                             block_extra_key(self.extra_key, self.block_extra_keys, index))


def gpu_sequence(seqs: Mapping[int, SequenceBlocks], seq_id: int) -> SequenceBlocks:
    """The record of sequence `seq_id`, which must be on the GPU (not swapped out)."""
    seq = seqs[seq_id]
    if seq.is_swapped:
        raise ValueError(f"sequence {seq_id} is swapped out")
    return seq
