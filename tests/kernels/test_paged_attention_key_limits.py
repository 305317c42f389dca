"""paged_attention with per-query key limits (a bidirectional image span's tokens see the whole span:
AttentionInputs.key_limits) equals the torch backend over the same bytes, full and window layers, split or
not, in several KV formats; the torch backend equals attention written out densely; without limits the
kernel is compiled without their loads. Triton's interpreter on a CPU, so shapes stay small."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from localserve.attention.base import AttentionGeometry
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.attention.triton_backend import TritonAttentionBackend
from tests.helpers.geometry_pools import geometry_batch
from tests.helpers.kv_pools import DEVICE

# (query_len, context_len) of each row: a decode, a chunk holding a whole span, a chunk starting inside a span
# (a prefix hit: its last keys only), a chunk of two spans.
SHAPES = [(1, 50), (30, 45), (12, 40), (40, 40)]
# (row, first position, end) of the spans: inside each chunk, each ending within its context.
SPANS = [(1, 20, 36), (2, 28, 35), (3, 3, 19), (3, 21, 37)]


def layer(window=None, sinks=False, softcap=None, heads=4, kv_heads=2, dim=32) -> AttentionGeometry:
    sink_logits = torch.randn(heads, generator=torch.Generator().manual_seed(1)) * 2 if sinks else None
    return AttentionGeometry(heads, kv_heads, dim, dim ** -0.5, window, sink_logits, softcap)


def limits_of(shapes, spans) -> torch.Tensor:
    """Each query token's last visible key: its own position, or its span's last token."""
    limits = []
    for row, (query_len, context_len) in enumerate(shapes):
        positions = list(range(context_len - query_len, context_len))
        for _, start, end in (span for span in spans if span[0] == row):
            positions = [end - 1 if start <= p < end else p for p in positions]
        limits += positions
    return torch.tensor(limits, dtype=torch.int64, device=DEVICE)


def dense(batch, limits: torch.Tensor, shapes) -> torch.Tensor:
    """The torch backend's answer checked against softmax written out: query i sees key j when j <= its limit
    (and j > its position - W)."""
    geometry, cache = batch.geometry, batch.cache
    outputs, start = [], 0
    transformed = cache.transform_query(0, batch.query).double()
    for row, (query_len, context_len) in enumerate(shapes):
        num_blocks = -(-context_len // cache.block_size)
        table = batch.inputs.block_tables[row:row + 1, :num_blocks].clamp(min=0)
        # Blocks wholly before a window were poisoned (NaN) by geometry_batch: masked out below, zeroed here.
        keys, values = (t[0, :context_len].double().nan_to_num(0.0, 0.0, 0.0) for t in cache.gather_blocks(0, table))
        group = geometry.num_heads // geometry.num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        query = transformed[start:start + query_len]
        scores = torch.einsum("qhd,khd->hqk", query, keys) * geometry.scale
        if geometry.logit_softcap is not None:
            scores = geometry.logit_softcap * torch.tanh(scores / geometry.logit_softcap)
        position = torch.arange(context_len - query_len, context_len, device=DEVICE)[:, None]
        key_pos = torch.arange(context_len, device=DEVICE)[None, :]
        seen = key_pos <= limits[start:start + query_len, None]
        if geometry.sliding_window is not None:
            seen &= key_pos > position - geometry.sliding_window
        scores = scores.masked_fill(~seen, float("-inf"))
        if geometry.sinks is not None:
            sinks = geometry.sinks.double().to(DEVICE)[:, None, None].expand(-1, query_len, 1)
            scores = torch.cat((scores, sinks), -1)
        probs = scores.softmax(-1)[..., :context_len]
        outputs.append(cache.restore_output(0, torch.einsum("hqk,khd->qhd", probs, values)))
        start += query_len
    return torch.cat(outputs)


def both(batch, num_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    torch_backend, triton_backend = TorchAttentionBackend(), TritonAttentionBackend(num_splits=num_splits)
    ours = triton_backend.attend(0, batch.query, batch.cache, triton_backend.build_metadata(batch.inputs),
                                 batch.geometry)
    reference = torch_backend.forward(0, batch.query, batch.key, batch.value, batch.cache,
                                      torch_backend.build_metadata(batch.inputs), batch.geometry)
    return ours, reference


# (geometry, K format, V format, splits)
CASES = [
    (dict(), "fp32", "fp32", 1),
    (dict(), "fp32", "fp32", 3),
    (dict(window=16), "fp32", "fp32", 1),  # the spans are 16 keys at most: within the window
    (dict(window=20, sinks=True, softcap=5.0), "q8_0", "q4_rot", 2),
    (dict(sinks=True), "bf16", "bf16", 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case)))
def test_key_limits_match_the_torch_backend_and_dense_attention(case):
    geometry, k_type, v_type, splits = case
    batch = geometry_batch(SHAPES, layer(**geometry), k_type, v_type, torch.float32, seed=splits)
    limits = limits_of(SHAPES, SPANS)
    batch.inputs.key_limits = limits
    ours, reference = both(batch, splits)
    torch.testing.assert_close(reference.double(), dense(batch, limits, SHAPES), atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(ours, reference, atol=3e-5, rtol=1e-4)
    # The limits matter here: without them the spans' rows give other outputs.
    batch.inputs.key_limits = None
    plain, _ = both(batch, splits)
    span_rows = limits != batch.inputs.positions
    assert not torch.allclose(plain[span_rows], ours[span_rows], atol=1e-3)
    torch.testing.assert_close(plain[~span_rows], ours[~span_rows], atol=3e-5, rtol=1e-4)


@given(data=st.data())
@example(data=None)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_generated_chunks_and_spans(data):
    """Generated chunks (1-24 tokens after 0-30 computed ones) with a span each ending within the chunk (a
    chunk may start inside it); the fixed example: a span of one token and a span filling its chunk."""
    if data is None:
        shapes, spans = [(5, 9), (24, 24)], [(0, 6, 7), (1, 0, 24)]
    else:
        shapes, spans = [], []
        for row in range(data.draw(st.integers(1, 3))):
            query_len, before = data.draw(st.integers(1, 24)), data.draw(st.integers(0, 30))
            context_len = query_len + before
            end = data.draw(st.integers(before + 1, context_len))
            start = data.draw(st.integers(max(0, end - 16), end - 1))
            shapes.append((query_len, context_len))
            if query_len > 1:
                spans.append((row, start, end))
    window = None if data is None else data.draw(st.sampled_from([None, 16, 24]))
    batch = geometry_batch(shapes, layer(window=window), "fp32", "fp32", torch.float32)
    limits = limits_of(shapes, spans)
    batch.inputs.key_limits = limits
    ours, reference = both(batch)
    torch.testing.assert_close(reference.double(), dense(batch, limits, shapes), atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(ours, reference, atol=3e-5, rtol=1e-4)


def test_bad_key_limits_are_refused():
    from localserve.kernels.paged_attention import paged_attention

    batch = geometry_batch([(3, 5)], layer(), "fp32", "fp32", torch.float32)
    backend = TritonAttentionBackend()
    plan = backend.plan(batch.inputs, 4, 2, torch.device(DEVICE), head_dim=32)
    formats = [codecs[0].kernel_format(torch.device(DEVICE)) for codecs in (batch.cache.key_codecs,
                                                                           batch.cache.value_codecs)]
    from localserve.attention.triton_backend import kv_store

    with pytest.raises(ValueError, match=r"key_limits must be int32 \[3\], not torch.int64 \(3,\)"):
        paged_attention(batch.query, kv_store(batch.cache.key_stores[0]), kv_store(batch.cache.value_stores[0]),
                        *formats, plan, 32 ** -0.5, key_limits=torch.arange(3, device=DEVICE))
