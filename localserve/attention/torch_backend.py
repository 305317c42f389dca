"""The plain-torch attention backend: the CPU path, and the reference the Triton kernels are tested against.

A batch mixes sequences in prefill (a chunk of several query tokens) and in decode (one query token);
every query token attends causally to its own sequence's context through the block table (a bidirectional
image span's tokens up to the span's end: `AttentionInputs.key_limits`). Per step,
`build_metadata` works out once what every layer needs: decodes are attended together in groups of
similar context length (quarter octaves of their block count), each prefill chunk in its own, each
with the blocks to gather and its mask; per KV group and sliding window, made by the first layer of
that kind. A window layer gathers only the blocks its window covers (O(window) a decode, never the
blocks before it). Sinks and a soft-cap take the explicit softmax; the rest stays in torch's
scaled_dot_product_attention.
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
    first_blocks: torch.Tensor | None = None  # [S] logical block of each row's first gathered block (a window)
    scratch: dict = field(default_factory=dict)  # the gather's buffers, reused by every layer of the step


@dataclass
class TorchAttentionMetadata:
    """The step's inputs and its attention groups per (KV group, sliding window), made on first use."""

    inputs: AttentionInputs
    by_kind: dict[tuple[int, int | None], list[AttentionGroup]] = field(default_factory=dict)

    def groups_of(self, layer: int, window: int | None) -> tuple[torch.Tensor, list[AttentionGroup]]:
        """The slot mapping of `layer`'s KV group and the attention groups of its window."""
        index, slots, tables = self.inputs.tables_of(layer)
        kind = (index, window)
        if kind not in self.by_kind:
            self.by_kind[kind] = make_groups(self.inputs, tables, window)
        return slots, self.by_kind[kind]


def make_groups(inputs: AttentionInputs, block_tables: torch.Tensor | None = None,
                window: int | None = None) -> list[AttentionGroup]:
    """The attention groups of a batch: its decodes by the number of blocks they read (`bucket_of` it), one
    per prefill chunk. `block_tables`: the KV group's (default: the inputs'); `window`: each query sees
    only its last `window` keys, and a sequence reads its blocks from the one holding the first key its
    first query sees (the entries before it are never read: they may be -1)."""
    block_tables = inputs.block_tables if block_tables is None else block_tables
    starts = [0]
    for q_len in inputs.query_lens:
        starts.append(starts[-1] + q_len)
    first_blocks = [0] * inputs.num_seqs
    if window is not None:
        first_blocks = [max(0, c - q - window + 1) // inputs.block_size
                        for q, c in zip(inputs.query_lens, inputs.context_lens, strict=True)]
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
            num_blocks = -(-inputs.context_lens[i] // inputs.block_size) - first_blocks[i]
            buckets.setdefault(bucket_of(num_blocks), []).append(i)
    for _, decode_rows in sorted(buckets.items()):
        token_index = torch.tensor([starts[i] for i in decode_rows], device=block_tables.device)
        groups.append(_group(inputs, block_tables, first_blocks, window, token_index, decode_rows, 1))
    for i, q_len in enumerate(inputs.query_lens):
        if q_len > 1:
            groups.append(_group(inputs, block_tables, first_blocks, window, slice(starts[i], starts[i + 1]), [i],
                                 q_len))
    return groups


def bucket_of(num_blocks: int) -> int:
    """The block count a decode row of `num_blocks` blocks is gathered up to: the next multiple of a quarter
    of the power of two at or above it (3/4 or all of it), so a row gathers at most 1.5x its blocks, in at
    most two groups an octave."""
    step = max(1, (1 << max(num_blocks - 1, 0).bit_length()) >> 2)
    return -(-num_blocks // step) * step


def _group(inputs: AttentionInputs, block_tables: torch.Tensor, first_blocks: list[int], window: int | None,
           token_index, rows: list[int], num_query: int) -> AttentionGroup:
    device = block_tables.device
    block_size = inputs.block_size
    context = torch.tensor([inputs.context_lens[i] for i in rows], device=device)
    first = torch.tensor([first_blocks[i] for i in rows], device=device)
    own_blocks = (context + block_size - 1) // block_size - first  # [S] blocks each row reads
    # Keys are gathered by whole blocks: the step's index is one id per block, not one slot per key (a
    # per-key index is N x context int64s a step, several MB that push the engine's books out of the
    # caches); the mask hides the keys outside each row's context (and window). Rows read from their
    # first visible block; past its own blocks a row reads block 0, which the mask hides.
    num_blocks = int(own_blocks.max())
    logical = first[:, None] + torch.arange(num_blocks, device=device)[None, :]  # [S, B]
    reads = logical < (first + own_blocks)[:, None]
    key_blocks = torch.where(reads, block_tables[torch.tensor(rows, device=device)[:, None],
                                                 logical.clamp(max=block_tables.shape[1] - 1)], 0)
    key_pos = (first * block_size)[:, None] + torch.arange(num_blocks * block_size, device=device)[None, :]
    # Query j of a sequence sits at position context - Q + j and sees the keys up to that position, or up to
    # its key limit (a bidirectional image span's tokens: only a chunk's, a decode sees up to itself).
    query_pos = context[:, None] - num_query + torch.arange(num_query, device=device)[None, :]
    last_key = query_pos
    if inputs.key_limits is not None and num_query > 1:
        last_key = inputs.key_limits[token_index].view(1, num_query)
    mask = key_pos[:, None, :] <= last_key[:, :, None]  # [S, Q, B * block_size]
    if window is not None:
        mask &= key_pos[:, None, :] > query_pos[:, :, None] - window
    return AttentionGroup(token_index, key_blocks, mask[:, None], num_query, first if window is not None else None)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
           geometry: AttentionGeometry, head_sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of query [S, Hq, Q, D] over key / value [S, Hk, K, D] (Hq a multiple of Hk: query
    head h reads KV head h // (Hq / Hk)) under `mask` [S, 1, Q, K] (True: seen), with `geometry`'s soft-cap
    and `head_sinks` (each query row's sink logit, broadcast to [S, Hq, Q, 1])."""
    if head_sinks is None and geometry.logit_softcap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=geometry.scale,
                                              enable_gqa=query.shape[1] != key.shape[1])
    compute = torch.promote_types(query.dtype, torch.float32)
    if query.shape[1] != key.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scores = query.to(compute) @ key.to(compute).transpose(-1, -2) * geometry.scale
    if geometry.logit_softcap is not None:
        scores = geometry.logit_softcap * torch.tanh(scores / geometry.logit_softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if head_sinks is not None:  # one more logit per row: it takes probability and brings no value
        scores = torch.cat((scores, head_sinks.to(compute).expand(*scores.shape[:-1], 1)), dim=-1)
    probs = scores.softmax(-1)[..., :key.shape[2]]
    return (probs @ value.to(compute)).to(query.dtype)


def check_layer_cache(layer: int, geometry: AttentionGeometry, kv_cache: PagedKVCache) -> None:
    """Raise ValueError where the layer's cache was not made for the layer's geometry."""
    codec = kv_cache.key_codecs[layer]
    if (codec.num_kv_heads, codec.head_dim) != (geometry.num_kv_heads, geometry.head_dim):
        raise ValueError(f"layer {layer} attends with {geometry.num_kv_heads} KV heads x {geometry.head_dim}, its "
                         f"cache holds {codec.num_kv_heads} x {codec.head_dim}")
    if kv_cache.keys_are_values(layer) and not geometry.keys_are_values:
        raise ValueError(f"layer {layer}'s cache keeps no values (its keys are its values), its attention "
                         "has values of its own")


class TorchAttentionBackend(AttentionBackend):
    """Plain-torch paged attention. Decodes of similar context length are batched together; each prefill
    chunk runs on its own."""

    name = "torch"

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(inputs)

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, metadata: TorchAttentionMetadata,
                geometry: AttentionGeometry | None = None) -> torch.Tensor:
        geometry = geometry or AttentionGeometry.plain(query, key)
        check_layer_cache(layer, geometry, kv_cache)
        inputs = metadata.inputs
        slot_mapping, groups = metadata.groups_of(layer, geometry.sliding_window)
        kv_cache.write(layer, key, key if geometry.keys_are_values else value, slot_mapping, inputs.positions)
        # A rotated (quantized) cache: rotate the query once, attend in the cache's domain, un-rotate once.
        query = kv_cache.transform_query(layer, query)
        output = torch.empty_like(query)
        num_heads, head_dim = query.shape[1:]
        sinks = geometry.sinks
        for group in groups:
            # [S, B * block_size, Hkv, D] each, into the group's buffers (the same for every layer)
            key_ctx, value_ctx = kv_cache.gather_blocks(layer, group.key_blocks, group.scratch,
                                                       group.first_blocks)
            key_ctx, value_ctx = key_ctx.transpose(1, 2).to(query.dtype), value_ctx.transpose(1, 2).to(query.dtype)
            group_query = query[group.token_index]
            if group.num_query == 1:
                # Decodes: the query heads sharing a KV head become that head's query rows, so no
                # grouped-query expansion is needed: [S, Hkv, H / Hkv, D].
                num_kv_heads = key_ctx.shape[1]
                group_query = group_query.view(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)
                head_sinks = None if sinks is None else sinks.view(1, num_kv_heads, -1, 1)
                out = attend(group_query, key_ctx, value_ctx, group.mask, geometry, head_sinks)
                output[group.token_index] = out.reshape(-1, num_heads, head_dim)
            else:
                group_query = group_query.view(-1, group.num_query, num_heads, head_dim).transpose(1, 2)
                head_sinks = None if sinks is None else sinks.view(1, num_heads, 1, 1)
                out = attend(group_query, key_ctx, value_ctx, group.mask, geometry, head_sinks)
                output[group.token_index] = out.transpose(1, 2).reshape(-1, num_heads, head_dim)
        return kv_cache.restore_output(layer, output)
