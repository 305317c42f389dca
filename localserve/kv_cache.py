"""The paged KV pool: per layer, K and V for `num_blocks` blocks of `block_size` tokens.

The block manager hands out block ids; this module owns the bytes behind them.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    """K and V caches of shape [num_blocks, block_size, num_kv_heads, head_dim] for each layer."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", num_cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # The swap space: the same layout in CPU memory (pinned when the pool is on a GPU).
        cpu_shape = (num_cpu_blocks, *shape[1:])
        pin = torch.device(device).type == "cuda"
        self.cpu_key_caches = [torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.cpu_value_caches = [torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store key/value [T, Hkv, D] at flat slots [T] (block * block_size + offset)."""
        key_cache, value_cache = self.key_caches[layer], self.value_caches[layer]
        key_cache.view(-1, *key_cache.shape[2:])[slot_mapping] = key.to(key_cache.dtype)
        value_cache.view(-1, *value_cache.shape[2:])[slot_mapping] = value.to(value_cache.dtype)

    def gather(self, layer: int, block_tables: torch.Tensor, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of each sequence's first `max_context` tokens: [S, max_context, Hkv, D] each."""
        num_blocks_needed = -(-max_context // self.block_size)
        tables = block_tables[:, :num_blocks_needed]
        num_seqs = tables.shape[0]
        key = self.key_caches[layer][tables].view(num_seqs, -1, *self.key_caches[layer].shape[2:])
        value = self.value_caches[layer][tables].view(num_seqs, -1, *self.value_caches[layer].shape[2:])
        return key[:, :max_context], value[:, :max_context]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy-on-write) in every layer: each (source, destination)."""
        if not pairs:
            return
        device = self.key_caches[0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for cache in (*self.key_caches, *self.value_caches):
            cache[dst] = cache[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks to the CPU pool: each (gpu_block, cpu_block), in every layer."""
        self._move(pairs, self.key_caches + self.value_caches, self.cpu_key_caches + self.cpu_value_caches)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks back from the CPU pool: each (cpu_block, gpu_block), in every layer."""
        self._move(pairs, self.cpu_key_caches + self.cpu_value_caches, self.key_caches + self.value_caches)

    @staticmethod
    def _move(pairs: list[tuple[int, int]], sources: list[torch.Tensor], destinations: list[torch.Tensor]) -> None:
        if not pairs:
            return
        for source, destination in zip(sources, destinations):
            src = torch.tensor([s for s, _ in pairs], device=source.device)
            dst = torch.tensor([d for _, d in pairs], device=destination.device)
            destination[dst] = source[src].to(destination.device, non_blocking=True)
