"""The plain-torch backend groups decodes by context length: a row gathers at most 1.5x its own blocks
(quarter octaves), and every token's output equals attending to its own context alone (dense softmax
attention in torch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.attention.base import AttentionInputs
from localserve.attention.torch_backend import bucket_of, make_groups

BLOCK = 4


def inputs_for(query_lens: list[int], context_lens: list[int], max_blocks: int) -> AttentionInputs:
    num_seqs = len(query_lens)
    tables = torch.arange(num_seqs * max_blocks).view(num_seqs, max_blocks)  # sequence s owns its own blocks
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    slots = torch.cat([tables[s, positions_s // BLOCK] * BLOCK + positions_s % BLOCK for s, positions_s in
                       enumerate(torch.arange(c - q, c) for q, c in zip(query_lens, context_lens))])
    return AttentionInputs(slots, positions, tables, query_lens, context_lens, BLOCK)


@pytest.mark.parametrize("num_blocks, gathered", [
    (1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (6, 6), (7, 8), (8, 8),  # small: whole blocks, at most 1.5x
    (16, 16), (17, 24), (24, 24), (25, 32), (33, 48), (48, 48), (49, 64), (64, 64), (65, 96)])
def test_a_decode_row_gathers_up_to_the_next_quarter_octave(num_blocks, gathered):
    assert bucket_of(num_blocks) == gathered and gathered <= 1.5 * num_blocks


def test_decodes_within_one_octave_make_at_most_two_groups():
    context_lens = [BLOCK * blocks for blocks in range(33, 65)]  # 33-64 blocks: groups of 48 and 64
    groups = make_groups(inputs_for([1] * len(context_lens), context_lens, 64))
    assert sorted(group.key_blocks.shape[1] for group in groups) == [48, 64]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 1, 1, 3]), st.integers(1, 70)), min_size=1, max_size=9),
       st.integers(0, 2**31 - 1))
def test_groups_bound_the_padding_and_give_each_token_its_own_attention(rows, seed):
    query_lens = [q for q, _ in rows]
    context_lens = [max(q, c) for q, c in rows]
    max_blocks = -(-max(context_lens) // BLOCK)
    inputs = inputs_for(query_lens, context_lens, max_blocks)
    groups = make_groups(inputs)

    covered = []
    for group in groups:
        index = group.token_index
        rows_of_group = ([r for r in range(len(rows)) if sum(query_lens[:r]) in index.tolist()]
                         if isinstance(index, torch.Tensor) else [next(r for r in range(len(rows))
                                                                       if sum(query_lens[:r]) == index.start)])
        covered += rows_of_group
        gathered = group.key_blocks.shape[1]
        for r in rows_of_group:
            own = -(-context_lens[r] // BLOCK)
            assert own <= gathered and (group.num_query > 1 or gathered <= 1.5 * own)
    assert sorted(covered) == list(range(len(rows)))  # every sequence in exactly one group

    # Attention through the groups equals each token attending to its own context alone.
    generator = torch.Generator().manual_seed(seed)
    heads, dim = 2, 8
    keys = torch.randn(len(rows) * max_blocks * BLOCK, heads, dim, generator=generator, dtype=torch.float64)
    values = torch.randn(keys.shape, generator=generator, dtype=torch.float64)
    query = torch.randn(sum(query_lens), heads, dim, generator=generator, dtype=torch.float64)
    output = torch.zeros_like(query)
    for group in groups:
        slots = (group.key_blocks[..., None] * BLOCK + torch.arange(BLOCK)).flatten(1)  # [S, B * BLOCK]
        k, v = keys[slots].transpose(1, 2), values[slots].transpose(1, 2)  # [S, H, K, D]
        q = query[group.token_index].view(-1, group.num_query, heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask)
        output[group.token_index] = out.transpose(1, 2).reshape(-1, heads, dim)
    start = 0
    for r, (q_len, context) in enumerate(zip(query_lens, context_lens)):
        own = inputs.block_tables[r, :(-(-context // BLOCK))]
        slots = (own[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:context]
        for j in range(q_len):
            visible = context - q_len + j + 1
            scores = torch.einsum("hd,khd->hk", query[start + j], keys[slots[:visible]]) / dim**0.5
            expected = torch.einsum("hk,khd->hd", scores.softmax(-1), values[slots[:visible]])
            torch.testing.assert_close(output[start + j], expected)
        start += q_len
