"""Paged KV pools for the kernel tests: calibrated formats, filled mixed batches, the torch reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from localserve.kernels.rotary import apply_rope
from localserve.models.config import RopeConfig
from localserve.models.layers.rotary import RotaryEmbedding

from localserve.attention.base import AttentionInputs
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.kv.cache import PagedKVCache
from localserve.kv.calibration import LayerCalibration
from localserve.kv.formats import KVFormatSpec

BLOCK_SIZE = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gaussian(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rope_fn(head_dim: int):
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, device=DEVICE)
    return lambda positions: rotary(positions, torch.float32)


def calibration(num_kv_heads: int, head_dim: int, seed: int = 5) -> LayerCalibration:
    """Large key / value means (so the 4-bit mean is used) and a well-conditioned key transform."""
    mean = gaussian(num_kv_heads, head_dim, seed=seed) * 2 + 3
    transform = torch.eye(head_dim) + 0.2 * gaussian(num_kv_heads, head_dim, head_dim, seed=seed + 1) / math.sqrt(
        head_dim)
    return LayerCalibration(key_mean=mean, value_mean=mean.flip(-1) / 2, key_transform=transform)


def make_cache(k_type: str, v_type: str, num_kv_heads: int, head_dim: int, num_blocks: int,
               dtype: torch.dtype = torch.float32) -> PagedKVCache:
    layer_calibration = calibration(num_kv_heads, head_dim)

    class Calibration:
        def layer(self, index):
            return layer_calibration

    return PagedKVCache(1, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype, device=DEVICE,
                        key_format=KVFormatSpec.parse(k_type), value_format=KVFormatSpec.parse(v_type),
                        calibration=Calibration(), rope=rope_fn(head_dim))


def keys_at(positions: torch.Tensor, num_kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Keys after RoPE around the calibrated mean, with every tenth one far from it (mean not used)."""
    pre = calibration(num_kv_heads, head_dim).key_mean + gaussian(len(positions), num_kv_heads, head_dim, seed=seed)
    pre[::10] = gaussian(len(pre[::10]), num_kv_heads, head_dim, seed=seed + 1) * 0.5
    cos, sin = rope_fn(head_dim)(positions.to(DEVICE))
    return apply_rope(pre.to(DEVICE), cos, sin)


def values_near_mean(num_tokens: int, num_kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Values around the calibrated value mean, every tenth one far from it (mean not used)."""
    values = calibration(num_kv_heads, head_dim).value_mean + gaussian(num_tokens, num_kv_heads, head_dim, seed=seed)
    values[::10] = gaussian(len(values[::10]), num_kv_heads, head_dim, seed=seed + 1)
    return values.to(DEVICE)


@dataclass
class Batch:
    """One step over a filled pool: sequences (query_len, context_len) with scattered block tables."""

    cache: PagedKVCache
    inputs: AttentionInputs
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D] the step's new keys (already in the pool)
    value: torch.Tensor


def fill_batch(shapes: list[tuple[int, int]], k_type: str, v_type: str, num_heads: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype = torch.float32, seed: int = 0, spare_blocks: int = 3) -> Batch:
    """A pool holding every sequence's whole context (written by the torch codecs) and the step's query.

    Blocks come from a random permutation of the pool, so tables are scattered and never in order.
    """
    needed = [math.ceil(ctx / BLOCK_SIZE) for _, ctx in shapes]
    num_blocks = sum(needed) + spare_blocks
    cache = make_cache(k_type, v_type, num_kv_heads, head_dim, num_blocks, dtype)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(needed)
    tables, new_slots, new_positions, new_keys, new_values = [], [], [], [], []
    for index, ((query_len, context_len), count) in enumerate(zip(shapes, needed)):
        table, order = order[:count], order[count:]
        tables.append(table + [0] * (width - count))
        positions = torch.arange(context_len)
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions.tolist()],
                             device=DEVICE)
        key = keys_at(positions, num_kv_heads, head_dim, seed=100 * seed + 2 * index).to(dtype)
        value = values_near_mean(context_len, num_kv_heads, head_dim, seed=100 * seed + 2 * index + 1).to(dtype)
        cache.write(0, key, value, slots, positions.to(DEVICE))
        new = slice(context_len - query_len, context_len)
        new_slots.append(slots[new])
        new_positions.append(positions[new])
        new_keys.append(key[new])
        new_values.append(value[new])
    inputs = AttentionInputs(torch.cat(new_slots), torch.cat(new_positions).to(DEVICE),
                             torch.tensor(tables, device=DEVICE), [q for q, _ in shapes], [c for _, c in shapes],
                             BLOCK_SIZE)
    num_tokens = sum(q for q, _ in shapes)
    query = gaussian(num_tokens, num_heads, head_dim, seed=seed + 77).to(DEVICE, dtype)
    return Batch(cache, inputs, query, torch.cat(new_keys), torch.cat(new_values))


def torch_reference(batch: Batch, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch backend's output over the same stored bytes (its write stores the bytes already there),
    with the query in `dtype` (default: the batch's own)."""
    query = batch.query if dtype is None else batch.query.to(dtype)
    backend = TorchAttentionBackend()
    return backend.forward(0, query, batch.key, batch.value, batch.cache, backend.build_metadata(batch.inputs))


def store_snapshot(cache: PagedKVCache) -> dict[str, torch.Tensor]:
    """Every stored tensor of the pool, cloned, by name."""
    return {f"{side}.{name}": tensor.clone()
            for side, stores in (("key", cache.key_stores), ("value", cache.value_stores))
            for name, tensor in stores[0].items()}
