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
class AttentionMetadata:
    """Where each query token's K/V goes and what each sequence attends to.

    Tokens of one sequence are contiguous in the batch, sequences in `query_lens` order.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset written by each token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64; entries past a sequence's blocks are unused
    query_lens: list[int]  # [num_seqs] new tokens per sequence in this step
    context_lens: list[int]  # [num_seqs] tokens each sequence attends to, these new tokens included

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


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
        starts = [0]
        for q_len in metadata.query_lens:
            starts.append(starts[-1] + q_len)
        positions = token_positions(metadata, query.device) if kv_cache.needs_positions else None
        kv_cache.write(layer, key, value, metadata.slot_mapping, positions)
        # A rotated (quantized) cache: rotate the query once, attend in the cache's domain, un-rotate once.
        query = kv_cache.transform_query(layer, query)
        output = torch.empty_like(query)
        decode_rows = [i for i, q_len in enumerate(metadata.query_lens) if q_len == 1]
        if decode_rows:
            token_index = torch.tensor([starts[i] for i in decode_rows], device=query.device)
            lens = [metadata.context_lens[i] for i in decode_rows]
            output[token_index] = self._attend(layer, query[token_index].unsqueeze(1), kv_cache,
                                               metadata.block_tables[decode_rows], lens, [1] * len(lens)).squeeze(1)
        for i, q_len in enumerate(metadata.query_lens):
            if q_len > 1:
                rows = slice(starts[i], starts[i + 1])
                output[rows] = self._attend(layer, query[rows].unsqueeze(0), kv_cache,
                                            metadata.block_tables[i:i + 1], [metadata.context_lens[i]],
                                            [q_len]).squeeze(0)
        return kv_cache.restore_output(layer, output)

    @staticmethod
    def _attend(layer: int, query: torch.Tensor, kv_cache: PagedKVCache, block_tables: torch.Tensor,
                context_lens: list[int], query_lens: list[int]) -> torch.Tensor:
        """query [S, Q, H, D] for S sequences with Q query tokens each -> [S, Q, H, D]."""
        max_context = max(context_lens)
        key, value = kv_cache.gather(layer, block_tables, max_context)  # [S, L, Hkv, D]
        device = query.device
        key_pos = torch.arange(max_context, device=device)
        context = torch.tensor(context_lens, device=device)
        # Query j of a sequence sits at position context - q_len + j and sees keys up to that position.
        query_pos = context[:, None] - torch.tensor(query_lens, device=device)[:, None] \
            + torch.arange(query.shape[1], device=device)[None, :]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, Q, L]
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2).to(query.dtype), value.transpose(1, 2).to(query.dtype),
            attn_mask=mask[:, None], enable_gqa=True)
        return out.transpose(1, 2)
