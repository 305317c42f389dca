"""The per-step plan of paged_attention: which query tile belongs to which sequence, tile sizes, KV splits.

Built once per step on the host from the step's query and context lengths (vectorised, no loop over
sequences) and shared by every layer. Its small index arrays travel to the device in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

MIN_KEYS_PER_SPLIT = 256  # a split shorter than this costs more in its merge than it gains
MAX_SPLITS = 16
DECODE_BLOCK_M = 16  # rows of a decode tile: the smallest tl.dot side
PREFILL_BLOCK_M = 64
BLOCK_N = 64  # keys per tile


@dataclass
class AttentionPlan:
    """Index arrays on the device (int32) and the compile-time tile shape of one step's attention."""

    query_start: torch.Tensor  # [S + 1] first query token of each sequence in the batch, then T
    seq_lens: torch.Tensor  # [S] context length of each sequence, its new tokens included
    block_tables: torch.Tensor  # [S, max_blocks] physical block of each logical block
    tile_seq: torch.Tensor  # [num_tiles] sequence of each query tile; -1 marks a padding tile
    tile_start: torch.Tensor  # [num_tiles] first query of each tile within its sequence's new tokens
    block_m: int  # rows (query, head) per tile: a power of two >= the group size
    block_n: int  # keys per tile
    num_splits: int  # programs sharing the keys of one tile (1: no split, no merge)
    max_seq_len: int


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int | None) -> int:
    """Split the keys when the batch alone would leave the device's multiprocessors idle (long decodes);
    `max_seq_len`: the most keys a program reads (a window layer's: its window and its chunk)."""
    if not num_sms or num_programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, num_programs)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def plan_attention(query_lens: list[int] | torch.Tensor, seq_lens: list[int] | torch.Tensor,
                   block_tables: torch.Tensor, num_heads: int, num_kv_heads: int,
                   num_splits: int | None = None, num_sms: int | None = None, block_m: int | None = None,
                   block_n: int = BLOCK_N, num_tiles: int | None = None, head_dim: int = 128,
                   window: int | None = None, max_block_m: int | None = None) -> AttentionPlan:
    """Plan a step of sequences with `query_lens` new tokens and `seq_lens` context each [S].

    `block_tables` [S, max_blocks] may already be on the device. `num_splits` None chooses from the
    batch, the longest context (within `window` keys of each query, for a window layer) and `num_sms`.
    `num_tiles` pads the tile list with padding tiles (a captured graph's fixed grid). `block_m` None picks
    16 rows for decode-only steps and otherwise 64 at head size 128 or less, 32 at 256, 16 at 512 (the
    fp32 accumulator of a tile, [rows, D], stays in registers); `max_block_m` caps that choice (the
    operands' own limit: paged_attention.prefill_rows_cap).
    """
    query_lens = torch.as_tensor(query_lens, dtype=torch.int32, device="cpu")
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int32, device="cpu")
    num_seqs = query_lens.shape[0]
    if seq_lens.shape != (num_seqs,) or block_tables.shape[0] != num_seqs:
        raise ValueError("query_lens, seq_lens and block_tables must describe the same sequences")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    if bool((query_lens > seq_lens).any()) or bool((query_lens < 0).any()):
        raise ValueError("each sequence needs 0 <= query_len <= seq_len")
    group = num_heads // num_kv_heads
    max_query_len = int(query_lens.max()) if num_seqs else 0
    if block_m is None:
        prefill_block_m = max(DECODE_BLOCK_M, PREFILL_BLOCK_M * 128 // max(head_dim, 128))
        block_m = DECODE_BLOCK_M if max_query_len <= 1 else prefill_block_m
        if max_block_m is not None:
            block_m = min(block_m, max_block_m)
    block_m = max(block_m, triton.next_power_of_2(group))
    queries_per_tile = block_m // group
    tiles_per_seq = (query_lens + queries_per_tile - 1) // queries_per_tile
    tile_seq = torch.repeat_interleave(torch.arange(num_seqs, dtype=torch.int32), tiles_per_seq)
    first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
    tile_start = (torch.arange(tile_seq.shape[0], dtype=torch.int32) - first_tile[tile_seq.long()]) * queries_per_tile
    if num_tiles is not None:
        if num_tiles < tile_seq.shape[0]:
            raise ValueError(f"the step needs {tile_seq.shape[0]} tiles, more than the {num_tiles} asked for")
        padding = num_tiles - tile_seq.shape[0]
        tile_seq = torch.cat((tile_seq, torch.full((padding,), -1, dtype=torch.int32)))
        tile_start = torch.cat((tile_start.int(), torch.zeros(padding, dtype=torch.int32)))
    max_seq_len = int(seq_lens.max()) if num_seqs else 0
    if num_splits is None:
        keys_read = max_seq_len if window is None else min(max_seq_len, window + max_query_len)
        num_splits = choose_num_splits(tile_seq.shape[0] * num_kv_heads, keys_read, num_sms)
    query_start = torch.cat((torch.zeros(1, dtype=torch.int32), torch.cumsum(query_lens, 0).int()))
    device = block_tables.device
    # One host-to-device copy for all the small arrays.
    packed = torch.cat((query_start, seq_lens, tile_seq, tile_start.int())).to(device, non_blocking=True)
    sizes = (num_seqs + 1, num_seqs, tile_seq.shape[0], tile_seq.shape[0])
    query_start_d, seq_lens_d, tile_seq_d, tile_start_d = torch.split(packed, sizes)
    return AttentionPlan(query_start_d, seq_lens_d, block_tables.to(torch.int32), tile_seq_d, tile_start_d,
                         block_m, block_n, num_splits, max_seq_len)
