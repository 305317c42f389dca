"""paged_attention with per-layer geometry (sliding window, sinks, soft-cap, head sizes 256 / 512, keys as
values) against attention written out densely over the same stored bytes, which the torch backend equals
(tests/attention/test_geometry_reference.py); Triton's interpreter on a CPU, so shapes stay small."""

from __future__ import annotations

import pytest
import torch
from localserve.kernels.attention_plan import plan_attention
from localserve.kernels.paged_attention import paged_attention

from localserve.attention import backend_class
from localserve.attention.base import AttentionGeometry, AttentionInputs, GroupTables
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.attention.triton_backend import TritonAttentionBackend, kv_store
from tests.helpers.geometry_pools import geometry_batch
from tests.helpers.kv_pools import DEVICE

# Decodes several windows long, a chunk crossing the window edge mid-block, a prompt's first chunk.
SHAPES = [(1, 97), (23, 75), (1, 40), (9, 9)]


def layer(heads=4, kv_heads=2, dim=32, window=None, sinks=False, softcap=None, kv=False, seed=0):
    sink_logits = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2 if sinks else None
    return AttentionGeometry(heads, kv_heads, dim, dim ** -0.5, window, sink_logits, softcap, kv)


def triton_attend(batch, num_splits: int = 1) -> torch.Tensor:
    backend = TritonAttentionBackend(num_splits=num_splits)
    return backend.attend(0, batch.query, batch.cache, backend.build_metadata(batch.inputs), batch.geometry)


def check(out: torch.Tensor, batch) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), batch.expected, atol=3e-5, rtol=1e-4)
    else:  # half precision: near the exact result
        error = ((out.double() - batch.expected).norm() / batch.expected.norm()).item()
        assert error < 1.5e-2


# (geometry, K format, V format, splits, dtype)
CASES = [
    (dict(window=16), "fp32", "fp32", 1, torch.float32),
    (dict(window=16, sinks=True), "fp32", "fp32", 3, torch.float32),  # a sink counted once over 3 splits
    (dict(window=20, sinks=True, softcap=5.0), "q8_0", "q4_rot", 2, torch.float32),
    (dict(window=32, softcap=2.0), "bf16", "bf16", 1, torch.bfloat16),
    (dict(sinks=True, kv=True), "q4_rot", "q4_rot", 2, torch.float32),
    (dict(window=17, kv=True), "q8_0", "q8_0", 1, torch.float32),
    (dict(dim=256, kv_heads=1, window=24, sinks=True), "q4_rot", "q8_0", 2, torch.float32),
    (dict(dim=256, kv=True, softcap=30.0), "fp16", "fp16", 1, torch.float16),
    (dict(window=1, sinks=True), "fp32", "fp32", 2, torch.float32),
    (dict(window=500, sinks=True), "fp32", "fp32", 2, torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case[:4])))
def test_geometry_matches_dense_attention(case):
    shape, k_type, v_type, splits, dtype = case
    batch = geometry_batch(SHAPES, layer(**shape), k_type, v_type, dtype, seed=splits)
    if shape.get("window", 999) <= 32:
        assert batch.skipped_blocks > 0  # -1 table entries and NaN blocks before every window
    out = triton_attend(batch, splits)
    check(out, batch)
    backend = TorchAttentionBackend()  # and the torch path over the same bytes (it rewrites the step's own)
    torch_out = backend.forward(0, batch.query, batch.key, batch.value, batch.cache,
                                backend.build_metadata(batch.inputs), batch.geometry)
    if dtype == torch.float32:
        torch.testing.assert_close(out, torch_out, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_a_layer_reads_and_writes_its_own_kv_groups_tables(name):
    """AttentionInputs.groups: the layer's group (layer_groups) gives its slots and block tables; the
    step's first tables (another group's block ids) are never used for it."""
    batch = geometry_batch([(1, 60), (7, 30)], layer(window=16, sinks=True), "fp32", "fp32")
    inputs = batch.inputs
    other = GroupTables(torch.full_like(inputs.slot_mapping, -1), torch.full_like(inputs.block_tables, -1))
    grouped = AttentionInputs(torch.full_like(inputs.slot_mapping, -1), inputs.positions,
                              torch.full_like(inputs.block_tables, -1), inputs.query_lens, inputs.context_lens,
                              inputs.block_size, groups=[other, GroupTables(inputs.slot_mapping, inputs.block_tables)],
                              layer_groups=[1])
    backend = backend_class(name)()
    out = backend.forward(0, batch.query, batch.key, batch.value, batch.cache, backend.build_metadata(grouped),
                          batch.geometry)
    torch.testing.assert_close(out.double(), batch.expected, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("k_type,v_type", [("bf16", "bf16"), ("q8_0", "q8_0"), ("q4_rot", "q4_rot")])
def test_head_size_512_with_keys_as_values(k_type, v_type):
    """Gemma 4's global layers: head size 512, one KV head, keys as values, in each KV format."""
    batch = geometry_batch([(1, 40), (5, 21)], layer(8, 1, 512, kv=True, sinks=True), k_type, v_type,
                           torch.float32)
    check(triton_attend(batch, 2), batch)


def test_forward_writes_keys_only_and_attends_like_the_dense_reference():
    """The backend's forward on a keys-as-values layer: store_kv writes the keys (the layer's only store)."""
    batch = geometry_batch([(1, 30), (6, 22)], layer(window=16, kv=True), "fp32", "fp32")
    stores = batch.cache.key_stores[0]["values"]
    stores.view(-1, *stores.shape[2:])[batch.inputs.slot_mapping] = 0
    backend = TritonAttentionBackend()
    out = backend.forward(0, batch.query, batch.key, batch.value, batch.cache, backend.build_metadata(batch.inputs),
                          batch.geometry)
    torch.testing.assert_close(out.double(), batch.expected, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_window_decode_visits_only_the_tiles_its_window_covers(num_splits):
    """O(window), not O(context): a decode at position 999 with a window of 32 visits only the key tiles
    (16 keys each: an fp32 model's) holding its window, whatever the split; a full layer visits all 63."""
    batch = geometry_batch([(1, 1000), (1, 70)], layer(window=32), "fp32", "fp32")
    meta = batch.inputs
    plan = plan_attention(meta.query_lens, meta.context_lens, meta.block_tables, 4, 2, num_splits=num_splits)
    cache = batch.cache
    formats = [codecs[0].kernel_format(torch.device(DEVICE)) for codecs in (cache.key_codecs, cache.value_codecs)]
    counts = torch.zeros(plan.tile_seq.shape[0], 2, num_splits, dtype=torch.int32, device=DEVICE)
    out = paged_attention(batch.query, kv_store(cache.key_stores[0]), kv_store(cache.value_stores[0]), *formats, plan,
                          32 ** -0.5, window=32, tile_counts=counts)
    torch.testing.assert_close(out.double(), batch.expected, atol=3e-5, rtol=1e-4)
    visited = counts.sum(-1)  # [tiles, Hkv]
    assert visited[0].tolist() == [3, 3] and visited[1].tolist() == [3, 3]  # 968..999: tiles 60-62; 38..69: 2-4
    full = geometry_batch([(1, 1000)], layer(), "fp32", "fp32")
    plan = plan_attention([1], [1000], full.inputs.block_tables, 4, 2, num_splits=num_splits)
    counts = torch.zeros(1, 2, num_splits, dtype=torch.int32, device=DEVICE)
    paged_attention(full.query, kv_store(full.cache.key_stores[0]), kv_store(full.cache.value_stores[0]), *formats,
                    plan, 32 ** -0.5, tile_counts=counts)
    assert counts.sum(-1).tolist() == [[63, 63]]


def test_a_head_size_the_kernels_cannot_take_is_refused_naming_the_layer():
    ok = TritonAttentionBackend.unsupported_layer(3, layer(dim=512))
    assert ok is None
    reason = TritonAttentionBackend.unsupported_layer(3, layer(dim=96))
    assert reason == "its kernels need a head size that is a power of two from 16 to 512, layer 3's is 96"
    from localserve.attention import select_backend
    from localserve.kv.formats import KVFormatSpec

    fp16 = KVFormatSpec.parse("fp16")
    with pytest.raises(ValueError, match="'triton' cannot run here: .* layer 1's is 80"):
        select_backend("triton", torch.device("cuda"), fp16, fp16, 128, [layer(dim=128), layer(dim=80)])
