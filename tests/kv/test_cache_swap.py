"""Swapping blocks between the KV pool and its CPU swap space: the stored bytes of every layer, K and V,
come back exactly, and the host reads a device-to-host copy only after it has completed.

The CPU tests run the same functions the CUDA path runs (PagedKVCache.swap_out / swap_in over
HostTransfers); `DeferredTransfers` makes the CPU behave like an asynchronous device whose copies land
only when waited for, which is what a CUDA stream does to the host.
"""

from __future__ import annotations

import pytest
import torch

from localserve.kv.cache import HostTransfers, PagedKVCache
from localserve.kv.formats import KVFormatSpec

NUM_BLOCKS, NUM_CPU_BLOCKS, BLOCK_SIZE = 8, 6, 4


class DeferredTransfers(HostTransfers):
    """Device-to-host copies that land only at wait(); until then the host buffer holds garbage."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_landed = 0

    def to_host(self, host: torch.Tensor, source: torch.Tensor) -> None:
        self.pending.append((host, source.clone()))
        host.view(torch.uint8).fill_(0x7F)  # what a host would see before the copy lands

    def wait(self) -> None:
        for host, source in self.pending:
            host.copy_(source)
        self.num_landed += len(self.pending)
        self.pending.clear()


def make_cache(device, cache_type: str | None = None) -> PagedKVCache:
    spec = KVFormatSpec.parse(cache_type) if cache_type else None
    cache = PagedKVCache(2, NUM_BLOCKS, BLOCK_SIZE, 2, 32, torch.float32, device, num_cpu_blocks=NUM_CPU_BLOCKS,
                         key_format=spec, value_format=spec)
    generator = torch.Generator().manual_seed(0)
    for store in cache.key_stores + cache.value_stores:
        for tensor in store.values():
            random = torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8, generator=generator)
            tensor.view(torch.uint8).copy_(random)
    return cache


def stored(stores: list[dict[str, torch.Tensor]], blocks: list[int]) -> list[torch.Tensor]:
    """The stored bytes of these blocks in every layer and tensor, on the CPU."""
    return [tensor[blocks].cpu().view(torch.uint8) for store in stores for tensor in store.values()]


def swap_round_trip(cache: PagedKVCache, before_swap_out=lambda: None) -> None:
    gpu_blocks, cpu_blocks, back_to = [5, 1, 6], [2, 0, 4], [3, 7, 0]
    before = stored(cache.key_stores + cache.value_stores, gpu_blocks)
    before_swap_out()
    cache.swap_out([(gpu, cpu, 0) for gpu, cpu in zip(gpu_blocks, cpu_blocks)])
    for got, want in zip(stored(cache.cpu_key_stores + cache.cpu_value_stores, cpu_blocks), before, strict=True):
        assert torch.equal(got, want)
    for store in cache.key_stores + cache.value_stores:  # overwrite the blocks they come back into
        for tensor in store.values():
            tensor[back_to] = 0
    cache.swap_in([(cpu, gpu, 0) for cpu, gpu in zip(cpu_blocks, back_to)])
    for got, want in zip(stored(cache.key_stores + cache.value_stores, back_to), before, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("cache_type", [None, "q8_0"])
def test_swap_out_and_in_move_the_stored_bytes_of_every_layer(cache_type):
    swap_round_trip(make_cache("cpu", cache_type))


def test_swap_out_reads_the_host_copy_only_after_it_has_completed():
    cache = make_cache("cpu", "q8_0")
    cache.transfers = DeferredTransfers("cpu")
    swap_round_trip(cache)
    num_tensors = sum(len(store) for store in cache.key_stores + cache.value_stores)
    assert cache.transfers.num_landed == num_tensors  # every swapped-out tensor went through them
    # The fake does what a device does: read before wait() and the host sees garbage.
    host = torch.empty(3)
    cache.transfers.to_host(host, torch.ones(3))
    assert not torch.equal(host, torch.ones(3))
    cache.transfers.wait()
    assert torch.equal(host, torch.ones(3))


def test_the_cpu_path_stages_through_plain_memory():
    cache = make_cache("cpu")
    assert not cache.transfers.pinned
    assert not any(tensor.is_pinned() for tensor in cache.cpu_key_stores[0].values())


@pytest.mark.gpu
@pytest.mark.parametrize("cache_type", [None, "q8_0"])
def test_swap_on_cuda_moves_exactly_the_stored_bytes_even_behind_a_busy_stream(cache_type):
    cache = make_cache("cuda", cache_type)
    assert cache.transfers.pinned
    assert all(tensor.is_pinned() for tensor in cache.cpu_key_stores[0].values())  # q8_0: codes and scales
    # Keep the compute stream busy so the device-to-host copies land late: a host that reads them
    # before they complete sees the staging buffer's old contents.
    swap_round_trip(cache, before_swap_out=lambda: torch.cuda._sleep(200_000_000))
