"""The plain-torch attention backend: the CPU path, and the reference the Triton kernels are tested against.

A batch mixes sequences in prefill (a chunk of several query tokens) and in decode (one query token);
every query token attends causally to its own sequence's context through the block table. Per step,
`build_metadata` works out once what every layer needs: decodes are attended together in groups of
similar context length (quarter octaves of their block count), each prefill chunk in its own, each
with the blocks to gather and its mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from localserve.attention.base import AttentionBackend, AttentionGeometry, AttentionInputs

if TYPE_CHECKING:
    from localserve.kv.cache import PagedKVCache


@dataclass
class AttentionGroup:
    """Sequences attended together: decodes of similar context length, or one prefill chunk."""

    token_index: torch.Tensor | slice  # rows of the batch's query tokens: [S] for decodes, a slice for a chunk
    key_blocks: torch.Tensor  # [S, B] each sequence's first B blocks (B: the group's longest context's)
    mask: torch.Tensor  # [S, 1, Q, B * block_size] bool: causal, and keys past each context masked
    num_query: int  # Q
    scratch: dict = field(default_factory=dict)  # the gather's buffers, reused by every layer of the step


@dataclass
class TorchAttentionMetadata:
    inputs: AttentionInputs
    groups: list[AttentionGroup]


def make_groups(inputs: AttentionInputs) -> list[AttentionGroup]:
    """The attention groups of a batch: its decodes by context length (`bucket_of` their block count), one
    per prefill chunk."""
    starts = [0]
    for q_len in inputs.query_lens:
        starts.append(starts[-1] + q_len)
    groups = []
    # Decodes are gathered up to their group's longest context, so one long context among short ones
    # would make every row pay for it (17 decodes with one 400-token context among 115-token ones took
    # twice the step of the 16 short ones alone). Rows are grouped by `bucket_of` their block count. By
    # powers of two (up to twice its blocks a row), 16 decodes of 450-690 tokens took 295-362 ms a step on
    # the dev CPU (bf16), most rows gathering 64 blocks for 29-45; by quarter octaves, 151 ms; by
    # eighths, 132-200 ms, and slower than quarters at 8 rows (more groups, each a call per layer).
    buckets: dict[int, list[int]] = {}
    for i, q_len in enumerate(inputs.query_lens):
        if q_len == 1:
            num_blocks = -(-inputs.context_lens[i] // inputs.block_size)
            buckets.setdefault(bucket_of(num_blocks), []).append(i)
    for _, decode_rows in sorted(buckets.items()):
        token_index = torch.tensor([starts[i] for i in decode_rows], device=inputs.block_tables.device)
        groups.append(_group(inputs, token_index, decode_rows, 1))
    for i, q_len in enumerate(inputs.query_lens):
        if q_len > 1:
            groups.append(_group(inputs, slice(starts[i], starts[i + 1]), [i], q_len))
    return groups


def bucket_of(num_blocks: int) -> int:
    """The block count a decode row of `num_blocks` blocks is gathered up to: the next multiple of a quarter
    of the power of two at or above it (3/4 or all of it), so a row gathers at most 1.5x its blocks, in at
    most two groups an octave."""
    step = max(1, (1 << max(num_blocks - 1, 0).bit_length()) >> 2)
    return -(-num_blocks // step) * step


def _group(inputs: AttentionInputs, token_index, rows: list[int], num_query: int) -> AttentionGroup:
    device = inputs.block_tables.device
    block_size = inputs.block_size
    context_lens = [inputs.context_lens[i] for i in rows]
    # Keys are gathered by whole blocks: the step's index is one id per block, not one slot per key (a
    # per-key index is N x context int64s a step, several MB that push the engine's books out of the
    # caches); the mask hides the keys past each context.
    num_blocks = -(-max(context_lens) // block_size)
    key_blocks = inputs.block_tables[rows, :num_blocks]  # [S, B]
    key_pos = torch.arange(num_blocks * block_size, device=device)
    context = torch.tensor(context_lens, device=device)
    # Query j of a sequence sits at position context - Q + j and sees the keys up to that position.
    query_pos = context[:, None] - num_query + torch.arange(num_query, device=device)[None, :]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, Q, B * block_size]
    return AttentionGroup(token_index, key_blocks, mask[:, None], num_query)


class TorchAttentionBackend(AttentionBackend):
    """Plain-torch paged attention. Decodes of similar context length are batched together; each prefill
    chunk runs on its own."""

    name = "torch"

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(inputs, make_groups(inputs))

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, metadata: TorchAttentionMetadata,
                geometry: AttentionGeometry | None = None) -> torch.Tensor:
        geometry = geometry or AttentionGeometry.plain(query, key)
        geometry.check_plain(self.name)
        inputs = metadata.inputs
        kv_cache.write(layer, key, value, inputs.slot_mapping, inputs.positions)
        # A rotated (quantized) cache: rotate the query once, attend in the cache's domain, un-rotate once.
        query = kv_cache.transform_query(layer, query)
        output = torch.empty_like(query)
        num_heads, head_dim = query.shape[1:]
        for group in metadata.groups:
            # [S, B * block_size, Hkv, D] each, into the group's buffers (the same for every layer)
            key_ctx, value_ctx = kv_cache.gather_blocks(layer, group.key_blocks, group.scratch)
            key_ctx, value_ctx = key_ctx.transpose(1, 2).to(query.dtype), value_ctx.transpose(1, 2).to(query.dtype)
            group_query = query[group.token_index]
            if group.num_query == 1:
                # Decodes: the query heads sharing a KV head become that head's query rows, so no
                # grouped-query expansion is needed: [S, Hkv, H / Hkv, D].
                group_query = group_query.view(-1, key_ctx.shape[1], num_heads // key_ctx.shape[1], head_dim)
                out = F.scaled_dot_product_attention(group_query, key_ctx, value_ctx, attn_mask=group.mask,
                                                     scale=geometry.scale)
                output[group.token_index] = out.reshape(-1, num_heads, head_dim)
            else:
                group_query = group_query.view(-1, group.num_query, num_heads, head_dim).transpose(1, 2)
                out = F.scaled_dot_product_attention(group_query, key_ctx, value_ctx, attn_mask=group.mask,
                                                     scale=geometry.scale, enable_gqa=True)
                output[group.token_index] = out.transpose(1, 2).reshape(-1, num_heads, head_dim)
        return kv_cache.restore_output(layer, output)
