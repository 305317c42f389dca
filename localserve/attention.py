"""Paged attention: the metadata a batch carries, the backend interface, and the plain-torch backend.

The plain-torch backend is what the CPU path runs and the reference the Triton kernels are tested
against. A batch mixes sequences in prefill (a chunk of several query tokens) and in decode (one query
token); every query token attends causally to its own sequence's context through the block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from localserve.kv_cache import PagedKVCache


@dataclass
class AttentionGroup:
    """Sequences attended together: all decodes in one group, each prefill chunk in its own."""

    token_index: torch.Tensor | slice  # rows of the batch's query tokens: [S] for decodes, a slice for a chunk
    key_slots: torch.Tensor  # [S, L] flat KV slots each sequence attends to (L: longest context)
    mask: torch.Tensor  # [S, 1, Q, L] bool: causal, and past-the-end keys masked
    num_query: int  # Q


@dataclass
class AttentionMetadata:
    """Where each query token's K/V goes and what each sequence attends to.

    Tokens of one sequence are contiguous in the batch, sequences in `query_lens` order. What every
    layer needs to attend (slots to gather, masks) is worked out once per step in `groups`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset written by each token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64; entries past a sequence's blocks are unused
    query_lens: list[int]  # [num_seqs] new tokens per sequence in this step
    context_lens: list[int]  # [num_seqs] tokens each sequence attends to, these new tokens included
    _groups: list[AttentionGroup] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def groups(self, block_size: int) -> list[AttentionGroup]:
        """The attention groups of this batch, computed on first use and shared by every layer."""
        if self._groups is None:
            self._groups = self._make_groups(block_size)
        return self._groups

    def _make_groups(self, block_size: int) -> list[AttentionGroup]:
        device = self.block_tables.device
        starts = [0]
        for q_len in self.query_lens:
            starts.append(starts[-1] + q_len)
        groups = []
        decode_rows = [i for i, q_len in enumerate(self.query_lens) if q_len == 1]
        if decode_rows:
            groups.append(self._group(torch.tensor([starts[i] for i in decode_rows], device=device),
                                      decode_rows, 1, block_size))
        for i, q_len in enumerate(self.query_lens):
            if q_len > 1:
                groups.append(self._group(slice(starts[i], starts[i + 1]), [i], q_len, block_size))
        return groups

    def _group(self, token_index, rows: list[int], num_query: int, block_size: int) -> AttentionGroup:
        device = self.block_tables.device
        context_lens = [self.context_lens[i] for i in rows]
        max_context = max(context_lens)
        key_pos = torch.arange(max_context, device=device)
        tables = self.block_tables[rows][:, key_pos // block_size]  # [S, L]
        key_slots = tables * block_size + key_pos % block_size
        context = torch.tensor(context_lens, device=device)
        # Query j of a sequence sits at position context - Q + j and sees the keys up to that position.
        query_pos = context[:, None] - num_query + torch.arange(num_query, device=device)[None, :]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, Q, L]
        return AttentionGroup(token_index, key_slots, mask[:, None], num_query)


def token_positions(metadata: AttentionMetadata, device: torch.device | str) -> torch.Tensor:
    """The position of each new token of the batch [num_tokens]: its sequence's last query_len positions."""
    return torch.cat([torch.arange(ctx - q_len, ctx, device=device)
                      for q_len, ctx in zip(metadata.query_lens, metadata.context_lens, strict=True)])


class AttentionBackend(Protocol):
    """Writes one layer's new K/V into the paged cache and attends over it."""

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, metadata: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> output [T, H, D]."""
        ...


class TorchAttentionBackend:
    """Plain-torch paged attention. Decodes are batched together; each prefill chunk runs on its own."""

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, metadata: AttentionMetadata) -> torch.Tensor:
        positions = token_positions(metadata, query.device) if kv_cache.needs_positions else None
        kv_cache.write(layer, key, value, metadata.slot_mapping, positions)
        # A rotated (quantized) cache: rotate the query once, attend in the cache's domain, un-rotate once.
        query = kv_cache.transform_query(layer, query)
        output = torch.empty_like(query)
        num_heads, head_dim = query.shape[1:]
        for group in metadata.groups(kv_cache.block_size):
            key_ctx, value_ctx = kv_cache.gather(layer, group.key_slots)  # [S, L, Hkv, D]
            key_ctx, value_ctx = key_ctx.transpose(1, 2).to(query.dtype), value_ctx.transpose(1, 2).to(query.dtype)
            group_query = query[group.token_index]
            if group.num_query == 1:
                # Decodes: the query heads sharing a KV head become that head's query rows, so no
                # grouped-query expansion is needed: [S, Hkv, H / Hkv, D].
                group_query = group_query.view(-1, key_ctx.shape[1], num_heads // key_ctx.shape[1], head_dim)
                out = F.scaled_dot_product_attention(group_query, key_ctx, value_ctx, attn_mask=group.mask)
                output[group.token_index] = out.reshape(-1, num_heads, head_dim)
            else:
                group_query = group_query.view(-1, group.num_query, num_heads, head_dim).transpose(1, 2)
                out = F.scaled_dot_product_attention(group_query, key_ctx, value_ctx, attn_mask=group.mask,
                                                     enable_gqa=True)
                output[group.token_index] = out.transpose(1, 2).reshape(-1, num_heads, head_dim)
        return kv_cache.restore_output(layer, output)
