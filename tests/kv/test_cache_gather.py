"""Gathering blocks into buffers kept from one layer to the next (`PagedKVCache.gather_blocks`'s
`scratch`) gives what a fresh gather gives, in every KV format, when the buffers are reused for
other blocks, for another layer, and when the step's block count changes (new buffers)."""

from __future__ import annotations

import pytest
import torch

from localserve.kv.cache import PagedKVCache
from localserve.kv.formats import FORMAT_NAMES, KVFormatSpec

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 12, 4, 2, 32


def filled_cache(cache_type: str) -> PagedKVCache:
    spec = KVFormatSpec.parse(cache_type)
    cache = PagedKVCache(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu",
                         key_format=spec, value_format=spec)
    generator = torch.Generator().manual_seed(0)
    slots = torch.arange(NUM_BLOCKS * BLOCK_SIZE)
    positions = slots % (BLOCK_SIZE * 3)
    for layer in range(NUM_LAYERS):
        key, value = (torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
        cache.write(layer, key, value, slots, positions)
    return cache


@pytest.mark.parametrize("cache_type", FORMAT_NAMES)
def test_a_gather_into_kept_buffers_equals_a_fresh_one(cache_type):
    cache = filled_cache(cache_type)
    scratch: dict = {}
    for layer, blocks in ((0, [[3, 1, 7], [2, 9, 0]]), (1, [[3, 1, 7], [2, 9, 0]]), (1, [[5, 4, 11], [6, 8, 10]]),
                          (0, [[1], [2], [3]]), (1, [[11, 0, 3, 5]])):
        block_ids = torch.tensor(blocks)
        fresh = cache.gather_blocks(layer, block_ids)
        kept = cache.gather_blocks(layer, block_ids, scratch)
        for got, want in zip(kept, fresh, strict=True):
            assert got.shape == want.shape == (len(blocks), len(blocks[0]) * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
            assert torch.equal(got, want), (cache_type, layer, blocks)


@pytest.mark.filterwarnings("error")  # torch resizing a kept buffer of another size warns: a new one is made
def test_kept_buffers_are_reused_while_the_block_count_stays():
    cache = filled_cache("fp32")
    scratch: dict = {}
    first = cache.gather_blocks(0, torch.tensor([[3, 1], [2, 9]]), scratch)
    buffers = {key: tensor.data_ptr() for key, tensor in scratch.items()}
    second = cache.gather_blocks(1, torch.tensor([[5, 4], [6, 8]]), scratch)
    assert len(buffers) == 2 and {key: tensor.data_ptr() for key, tensor in scratch.items()} == buffers
    assert first[0].data_ptr() == second[0].data_ptr()  # the same memory: valid until the next gather
    cache.gather_blocks(1, torch.tensor([[5, 4, 1]]), scratch)  # 3 blocks, not 4: new buffers
    assert all(tensor.shape[0] == 3 for tensor in scratch.values())
