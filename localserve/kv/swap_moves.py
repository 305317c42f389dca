"""Preemption by swap: moving sequences' block tables between the GPU pools and the CPU swap tiers, the
work of the block manager's `swap_out` and `swap_in` (kv/block_manager.py), and the room each takes, which
the manager checks first. No torch: the block copies are returned, (source, destination, group), for the KV
pool to make.

A swap moves all of one request's sequences (its samples or beams) together, one copy per distinct block,
so shared blocks are copied once and stay shared. The tiers keep no prefix cache: a sequence swapped back
in registers its full computed blocks (in the state group, its policy checkpoints: kv/state_group.py) in
the prefix cache again where their keys are free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from localserve.kv.block_pool import NO_BLOCK, BlockMove, BlockPool
from localserve.kv.block_tier import BlockTier
from localserve.kv.sequence_blocks import SequenceBlocks
from localserve.kv.state_group import StateGroup


def distinct_blocks(seqs: Mapping[int, SequenceBlocks], seq_ids: Sequence[int], swapped: bool, group: int) -> list[int]:
    """Block ids of these sequences' tables in the group, each once, NO_BLOCK left out; all sequences
    must be in the pool named by `swapped`."""
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"sequence ids repeated: {list(seq_ids)}")
    block_ids: dict[int, None] = {}
    for seq_id in seq_ids:
        if seqs[seq_id].is_swapped != swapped:
            raise ValueError(f"sequence {seq_id} is {'not ' if swapped else ''}swapped out")
        block_ids.update(dict.fromkeys(seqs[seq_id].block_tables[group]))
    block_ids.pop(NO_BLOCK, None)
    return list(block_ids)


def move_out(pools: Sequence[BlockPool], tiers: Sequence[BlockTier], seqs: Sequence[SequenceBlocks]) -> list[BlockMove]:
    """Store the sequences' tables in the tiers, one copy per distinct block, releasing the GPU blocks."""
    moves = []
    for group, (pool, tier) in enumerate(zip(pools, tiers, strict=True)):
        cpu_tables, copies = tier.store([seq.block_tables[group] for seq in seqs])
        moves += [(gpu_block, cpu_block, group) for gpu_block, cpu_block in copies]
        for seq, cpu_table in zip(seqs, cpu_tables, strict=True):
            pool.release(reversed(seq.block_tables[group]))
            seq.block_tables[group] = cpu_table
    for seq in seqs:
        seq.is_swapped = True
    return moves


def fits_out(seqs: Mapping[int, SequenceBlocks], tiers: Sequence[BlockTier], seq_ids: Sequence[int]) -> bool:
    """True when every group's tier has room for the distinct blocks of these GPU sequences."""
    return all(len(distinct_blocks(seqs, seq_ids, swapped=False, group=group)) <= tier.num_free_blocks
               for group, tier in enumerate(tiers))


def blocks_to_move_in(seqs: Mapping[int, SequenceBlocks], seq_ids: Sequence[int], num_groups: int) -> list[int]:
    """Per group, the GPU blocks that bringing these swapped sequences back takes (shared blocks count once)."""
    return [len(distinct_blocks(seqs, seq_ids, swapped=True, group=group)) for group in range(num_groups)]


def move_in(pools: Sequence[BlockPool], tiers: Sequence[BlockTier], seqs: Mapping[int, SequenceBlocks],
            seq_ids: Sequence[int], block_size: int, state: StateGroup | None) -> list[BlockMove]:
    """Bring the swapped sequences' tables back into the pools; each entry with a key is entered in the
    prefix cache again where its key is free, in the state group only its policy checkpoints."""
    def registers(group: int, index: int, seq: SequenceBlocks) -> bool:
        return state is None or group != state.group or state.is_checkpoint(index, seq.num_prompt_tokens)

    moves = []
    for group, (pool, tier) in enumerate(zip(pools, tiers, strict=True)):
        cpu_block_ids = distinct_blocks(seqs, seq_ids, swapped=True, group=group)
        cpu_to_gpu = {cpu_block_id: pool.take_free_block() for cpu_block_id in cpu_block_ids}
        cpu_to_gpu[NO_BLOCK] = NO_BLOCK
        for block_id in cpu_block_ids:
            pool.ref_counts[cpu_to_gpu[block_id]] = 0  # counted below, once per table pointing at it
        for seq_id in seq_ids:
            seq = seqs[seq_id]
            tier.release(seq.block_tables[group])
            table = seq.block_tables[group] = [cpu_to_gpu[cpu_block_id] for cpu_block_id in seq.block_tables[group]]
            pool.share(table)
            for index, block_hash in enumerate(seq.block_hashes):
                if table[index] != NO_BLOCK and registers(group, index, seq):
                    pool.register(table[index], block_hash, seq.block_payload(index, block_size))
        moves += [(cpu_block, gpu_block, group) for cpu_block, gpu_block in cpu_to_gpu.items()
                  if cpu_block != NO_BLOCK]
    for seq_id in seq_ids:
        seqs[seq_id].is_swapped = False
    return moves
