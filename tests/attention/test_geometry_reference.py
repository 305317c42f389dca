"""The torch backend's attention with per-layer geometry (sliding window, sinks, soft-cap, head sizes up to
512, keys as values) equals attention written out densely, and its window / sink / soft-cap conventions
equal transformers' own eager attention for gpt-oss and Gemma 3 (the off-by-one of the window pinned)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.attention.base import AttentionGeometry, AttentionInputs
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.kv.cache import LayerKVShape, PagedKVCache
from tests.helpers.geometry_pools import dense_attention, geometry_batch

BLOCK = 16


def torch_forward(batch) -> torch.Tensor:
    backend = TorchAttentionBackend()
    return backend.forward(0, batch.query, batch.key, batch.value, batch.cache,
                           backend.build_metadata(batch.inputs), batch.geometry)


def geometry(heads=4, kv_heads=2, dim=32, window=None, sinks=False, softcap=None, kv=False, seed=0):
    sink_logits = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2 if sinks else None
    return AttentionGeometry(heads, kv_heads, dim, dim ** -0.5, window, sink_logits, softcap, kv)


@pytest.mark.parametrize("case", [
    dict(window=16), dict(window=20, sinks=True), dict(window=32, softcap=5.0), dict(sinks=True, kv=True),
    dict(window=1), dict(window=500), dict(dim=256, window=24, sinks=True), dict(dim=512, kv_heads=1, kv=True),
    dict(softcap=0.5, sinks=True, kv=True, window=17)], ids=str)
def test_torch_backend_equals_dense_attention(case):
    """Decodes several windows long, chunks crossing the window edge mid-block, a chunk from position 0."""
    shapes = [(1, 97), (1, 40), (23, 75), (9, 9), (1, 1)]
    batch = geometry_batch(shapes, geometry(**case), seed=len(case))
    if case.get("window", 999) < 60:
        assert batch.skipped_blocks > 0  # entries before the window are -1, their blocks NaN: never read
    torch.testing.assert_close(torch_forward(batch).double(), batch.expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k_type,v_type", [("bf16", "fp16"), ("q8_0", "q4_rot"), ("q4_rot", "q8_0"),
                                           ("q4_rot", "q4_rot")])
@pytest.mark.parametrize("dim,kv", [(64, False), (256, True), (512, True), (512, False)])
def test_every_kv_format_on_every_layer_kind(k_type, v_type, dim, kv):
    """Quantized and 16-bit pools, head sizes 256 / 512 and keys as values: the dense reference over the
    pool's decoded bytes (query and output mapped by the layer's codecs as the backend does)."""
    batch = geometry_batch([(1, 50), (12, 40)], geometry(4, 1, dim, window=20, sinks=True, kv=kv), k_type, v_type)
    torch.testing.assert_close(torch_forward(batch).double(), batch.expected, atol=2e-4, rtol=2e-4)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 90)), min_size=1, max_size=4),
       st.one_of(st.none(), st.integers(1, 70)), st.booleans(), st.sampled_from([None, 1.0, 30.0]),
       st.sampled_from([(4, 4, 32), (4, 1, 32), (6, 2, 64), (2, 1, 128)]), st.booleans(),
       st.sampled_from([("fp32", "fp32"), ("fp16", "bf16"), ("q8_0", "q8_0"), ("q4_rot", "q4_rot")]),
       st.integers(0, 1000))
def test_generated_geometries_equal_dense_attention(rows, window, sinks, softcap, heads, kv, formats, seed):
    shapes = [(max(1, min(q, q + extra)), q + extra) for q, extra in rows]
    shapes = [(q if q <= 8 else 1, c) for q, c in shapes]  # prefill chunks and decodes
    num_heads, kv_heads, dim = heads
    layer = geometry(num_heads, kv_heads, dim, window, sinks, softcap, kv, seed)
    batch = geometry_batch(shapes, layer, *formats, seed=seed)
    tolerance = 1e-5 if formats[0] == "fp32" else 3e-4
    torch.testing.assert_close(torch_forward(batch).double(), batch.expected, atol=tolerance, rtol=tolerance)


def test_window_of_one_sees_only_itself_and_a_window_past_the_context_sees_everything():
    batch = geometry_batch([(5, 30), (1, 17)], geometry(window=1))
    out = torch_forward(batch)
    values = batch.value.float()  # each token's own value (its group's, heads 2h and 2h+1 share KV head h)
    torch.testing.assert_close(out, values.repeat_interleave(2, dim=1), atol=1e-5, rtol=1e-5)
    wide = geometry_batch([(5, 30), (1, 17)], geometry(window=30))
    full = geometry_batch([(5, 30), (1, 17)], geometry())
    assert wide.skipped_blocks == 0
    torch.testing.assert_close(torch_forward(wide), torch_forward(full))


@pytest.mark.parametrize("field,value,message", [
    ("head_dim", 513, "head size 513: attention takes head sizes 1 to 512"),
    ("head_dim", 1024, "head size 1024: attention takes head sizes 1 to 512"),
    ("sliding_window", 0, "sliding window 0: a window holds at least one key"),
    ("logit_softcap", 0.0, "logit soft-cap 0.0: the cap must be positive"),
    ("sinks", torch.zeros(3), r"sinks of shape \(3,\): one logit per query head \(4\) expected")])
def test_a_geometry_past_its_limits_is_refused_naming_the_value(field, value, message):
    plain = geometry()
    dataclasses.replace(plain, head_dim=512)  # the limit itself is a head size
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(plain, **{field: value})


def test_a_cache_not_laid_out_for_the_layer_is_refused_by_name():
    batch = geometry_batch([(1, 20)], geometry(kv=True))
    backend = TorchAttentionBackend()
    metadata = backend.build_metadata(batch.inputs)
    with pytest.raises(ValueError, match="layer 0's cache keeps no values"):
        backend.forward(0, batch.query, batch.key, batch.value, batch.cache, metadata,
                        dataclasses.replace(batch.geometry, keys_are_values=False))
    with pytest.raises(ValueError, match="layer 0 attends with 1 KV heads x 32, its cache holds 2 x 32"):
        backend.forward(0, batch.query, batch.key[:, :1], batch.value, batch.cache, metadata,
                        dataclasses.replace(batch.geometry, num_kv_heads=1))


def test_keys_as_values_keep_no_value_store():
    shapes = [LayerKVShape(2, 64), LayerKVShape(1, 512, keys_are_values=True), LayerKVShape(4, 256)]
    cache = PagedKVCache(3, 4, BLOCK, 0, 0, torch.bfloat16, layer_shapes=shapes)
    assert cache.value_stores[1] is cache.key_stores[1]
    assert cache.bytes_per_token() == 2 * (2 * 2 * 64 + 512 + 2 * 4 * 256)
    assert [tuple(s["values"].shape[2:]) for s in cache.key_stores] == [(2, 64), (1, 512), (4, 256)]


def test_per_layer_pools_copy_and_swap_every_store_once():
    shapes = [LayerKVShape(2, 32), LayerKVShape(1, 64, keys_are_values=True)]
    cache = PagedKVCache(2, 4, BLOCK, 0, 0, torch.float32, num_cpu_blocks=2, layer_shapes=shapes)
    for layer, shape in enumerate(shapes):
        key = torch.randn(BLOCK, shape.num_kv_heads, shape.head_dim)
        cache.write(layer, key, None if shape.keys_are_values else key + 1, torch.arange(BLOCK) + BLOCK, None)
    before = [t.clone() for t in cache._all_tensors(cache.key_stores, cache.value_stores)]
    assert len(before) == 3  # K and V of layer 0, K (= V) of layer 1
    cache.copy_blocks([(1, 3)])
    cache.swap_out([(3, 0)])
    cache.swap_in([(0, 2)])
    for tensor, original in zip(cache._all_tensors(cache.key_stores, cache.value_stores), before, strict=True):
        assert torch.equal(tensor[2], original[1]) and torch.equal(tensor[3], original[1])
    keys, values = cache.gather_blocks(1, torch.tensor([[2]]))
    assert keys is values and torch.equal(keys[0], before[1][1])  # layer 1 keys: the second key store


def transformers_reference(family: str, window: int, length: int, seed: int):
    """Query / key / value and the output of `family`'s eager attention with its own sliding-window mask."""
    import transformers
    from transformers.masking_utils import create_sliding_window_causal_mask

    heads, kv_heads, dim = 4, 2, 32
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, length, dim, generator=generator) for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=generator)
    if family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

        config = transformers.GptOssConfig(sliding_window=window, num_attention_heads=heads,
                                           num_key_value_heads=kv_heads, head_dim=dim)
        kwargs, geometry_extra = {}, {"sinks": sinks}
    else:
        from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

        config = transformers.Gemma3TextConfig(sliding_window=window, num_attention_heads=heads,
                                               num_key_value_heads=kv_heads, head_dim=dim)
        kwargs, geometry_extra = {"softcap": 7.0}, {"logit_softcap": 7.0}
    config._attn_implementation = "eager"
    mask = create_sliding_window_causal_mask(config, torch.zeros(1, length, 8), None, None,
                                             position_ids=torch.arange(length)[None], allow_is_causal_skip=False)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, sinks=sinks, training=False,
                                   head_dim=dim)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5, dropout=0.0, **kwargs)
    geometry_ = AttentionGeometry(heads, kv_heads, dim, dim ** -0.5, window, **geometry_extra)
    return q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), out[0], geometry_


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_window_sinks_and_softcap_follow_transformers(family, window):
    """transformers' sliding-window mask keeps kv_idx > q_idx - W (the last W keys, the query's own
    included); the backend's window W over the paged pool gives the family's own eager attention."""
    length = 40
    query, key, value, expected, layer = transformers_reference(family, window, length, seed=window)
    torch.testing.assert_close(dense_attention(query, key, value, layer, 0).float(), expected, atol=1e-5, rtol=1e-5)
    cache = PagedKVCache(1, 4, BLOCK, 2, 32, torch.float32)
    table = torch.tensor([[3, 0, 2]])
    positions = torch.arange(length)
    slots = table[0, positions // BLOCK] * BLOCK + positions % BLOCK
    # A prompt in two chunks: the second crosses block and window edges.
    backend, outputs = TorchAttentionBackend(), []
    for chunk in (slice(0, 21), slice(21, length)):
        inputs = AttentionInputs(slots[chunk], positions[chunk], table, [chunk.stop - chunk.start], [chunk.stop], BLOCK)
        outputs.append(backend.forward(0, query[chunk], key[chunk], value[chunk], cache,
                                       backend.build_metadata(inputs), layer))
    torch.testing.assert_close(torch.cat(outputs), expected, atol=1e-5, rtol=1e-5)
