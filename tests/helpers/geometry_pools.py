"""Paged pools for layers of any geometry (window, sinks, soft-cap, head size, keys as values), and the
dense softmax reference every backend is checked against."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from localserve.attention.base import AttentionGeometry, AttentionInputs
from localserve.kv.cache import LayerKVShape, PagedKVCache
from localserve.kv.formats import KVFormatSpec
from tests.helpers.kv_pools import BLOCK_SIZE, DEVICE, calibration, gaussian, keys_at, rope_fn, values_near_mean


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, geometry: AttentionGeometry,
                    first_position: int) -> torch.Tensor:
    """One sequence's attention, written out: query [Q, H, D] at positions first_position.., keys / values
    [C, Hkv, D] at positions 0..C-1; in float64. Query i at position p sees key j when j <= p and, with a
    window W, j > p - W; a sink adds exp(sink) to the denominator only; the soft-cap squashes s = q.k*scale."""
    query, keys, values = query.double(), keys.double(), values.double()
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * geometry.scale
    if geometry.logit_softcap is not None:
        scores = geometry.logit_softcap * torch.tanh(scores / geometry.logit_softcap)
    query_pos = first_position + torch.arange(query.shape[0])[:, None]
    key_pos = torch.arange(keys.shape[0])[None, :]
    seen = key_pos <= query_pos
    if geometry.sliding_window is not None:
        seen &= key_pos > query_pos - geometry.sliding_window
    scores = scores.masked_fill(~seen.to(scores.device), float("-inf"))
    peak = scores.amax(-1, keepdim=True)
    if geometry.sinks is not None:
        peak = torch.maximum(peak, geometry.sinks.double().to(scores.device)[:, None, None])
    weights = torch.exp(scores - peak)
    denominator = weights.sum(-1, keepdim=True)
    if geometry.sinks is not None:
        denominator = denominator + torch.exp(geometry.sinks.double().to(scores.device)[:, None, None] - peak)
    return torch.einsum("hqk,khd->qhd", weights / denominator, values)


@dataclass
class GeometryBatch:
    cache: PagedKVCache
    inputs: AttentionInputs
    geometry: AttentionGeometry
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D] the step's new keys (already in the pool)
    value: torch.Tensor
    expected: torch.Tensor  # [T, H, D] float64: dense attention over the pool's decoded bytes
    skipped_blocks: int  # table entries set to -1 (wholly before a window) whose blocks hold NaN


def geometry_batch(shapes: list[tuple[int, int]], geometry: AttentionGeometry, k_type: str = "fp32",
                   v_type: str = "fp32", dtype: torch.dtype = torch.float32, seed: int = 0) -> GeometryBatch:
    """A one-layer pool laid out for `geometry` holding every sequence's context (query_len, context_len),
    with scattered block tables; the blocks wholly before a window layer's first query's window are then
    poisoned (NaN bytes) and their table entries set to -1, which no backend may read."""
    heads, kv_heads, dim = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
    needed = [math.ceil(ctx / BLOCK_SIZE) for _, ctx in shapes]
    num_blocks = sum(needed) + 2
    layer_calibration = calibration(kv_heads, dim)

    class Calibration:
        def layer(self, index):
            return layer_calibration

    cache = PagedKVCache(1, num_blocks, BLOCK_SIZE, kv_heads, dim, dtype, device=DEVICE,
                         key_format=KVFormatSpec.parse(k_type), value_format=KVFormatSpec.parse(v_type),
                         calibration=Calibration(), rope=rope_fn(dim),
                         layer_shapes=[LayerKVShape(kv_heads, dim, geometry.keys_are_values)])
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(needed)
    tables, slots_of, new = [], [], []
    for index, ((query_len, context_len), count) in enumerate(zip(shapes, needed, strict=True)):
        table, order = order[:count], order[count:]
        tables.append(table + [0] * (width - count))
        positions = torch.arange(context_len)
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions.tolist()],
                             device=DEVICE)
        key = keys_at(positions, kv_heads, dim, seed=100 * seed + 2 * index).to(dtype)
        value = key if geometry.keys_are_values else values_near_mean(context_len, kv_heads, dim,
                                                                      seed=100 * seed + 2 * index + 1).to(dtype)
        cache.write(0, key, value, slots, positions.to(DEVICE))
        slots_of.append(slots)
        new.append((slots[context_len - query_len:], positions[context_len - query_len:],
                     key[context_len - query_len:], value[context_len - query_len:]))
    tables_t = torch.tensor(tables, device=DEVICE)
    num_tokens = sum(q for q, _ in shapes)
    query = gaussian(num_tokens, heads, dim, seed=seed + 77).to(DEVICE, dtype)
    expected, start = [], 0
    transformed = cache.transform_query(0, query)
    for row, (query_len, context_len) in enumerate(shapes):
        keys, values = cache.gather_blocks(0, tables_t[row:row + 1, :needed[row]])
        out = dense_attention(transformed[start:start + query_len], keys[0, :context_len], values[0, :context_len],
                              geometry, context_len - query_len)
        expected.append(cache.restore_output(0, out))
        start += query_len
    skipped = 0
    if geometry.sliding_window is not None:
        for row, (query_len, context_len) in enumerate(shapes):
            first_block = geometry.window_start(context_len - query_len) // BLOCK_SIZE
            for logical in range(first_block):
                poison_block(cache, tables[row][logical])
                tables_t[row, logical] = -1
                skipped += 1
    inputs = AttentionInputs(torch.cat([n[0] for n in new]), torch.cat([n[1] for n in new]).to(DEVICE), tables_t,
                             [q for q, _ in shapes], [c for _, c in shapes], BLOCK_SIZE)
    return GeometryBatch(cache, inputs, geometry, query, torch.cat([n[2] for n in new]),
                         torch.cat([n[3] for n in new]), torch.cat(expected).double(), skipped)


def poison_block(cache: PagedKVCache, block: int) -> None:
    """NaN in every float tensor of `block` (int8 codes get their extreme value)."""
    for store in (cache.key_stores[0], cache.value_stores[0]):
        for tensor in store.values():
            extreme = -128 if tensor.dtype == torch.int8 else 255
            tensor[block] = float("nan") if tensor.dtype.is_floating_point else extreme
