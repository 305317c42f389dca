"""Generated cases: random mixed batches, head ratios, formats and splits through both backends.

Each case runs a whole step through the Triton backend (store_kv, then attention) on one pool and through
the torch backend on an identical one. Plain formats must store identical bytes; every format must
attend like the torch backend over the torch backend's bytes. Few examples: the interpreter is slow.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localserve.attention.triton_backend import TritonAttentionBackend
from tests.helpers.kv_pools import fill_batch, torch_reference

FORMATS = ["fp16", "bf16", "fp32", "q8_0", "q8_0:-rotation", "q4_rot", "q4_rot:-mean", "q4_rot:-codebook"]


@st.composite
def steps(draw):
    num_seqs = draw(st.integers(1, 3))
    shapes = []
    for _ in range(num_seqs):
        context_len = draw(st.integers(1, 90))
        shapes.append((draw(st.integers(0, min(context_len, 24))), context_len))
    if not any(query_len for query_len, _ in shapes):
        shapes[0] = (1, shapes[0][1])
    heads = draw(st.sampled_from([(2, 2), (4, 1), (9, 3), (8, 2)]))
    return (shapes, heads, draw(st.sampled_from(FORMATS)), draw(st.sampled_from(FORMATS)),
            draw(st.sampled_from([1, 2, 3])), draw(st.integers(0, 2 ** 16)))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_random_steps_match_the_torch_backend(step):
    shapes, (num_heads, num_kv_heads), k_type, v_type, num_splits, seed = step
    torch_batch, triton_batch = (fill_batch(shapes, k_type, v_type, num_heads, num_kv_heads, 64, seed=seed)
                                 for _ in range(2))
    slots = torch_batch.inputs.slot_mapping
    for cache in (torch_batch.cache, triton_batch.cache):  # forget the step's tokens, so forward writes them
        for store in (*cache.key_stores[0].values(), *cache.value_stores[0].values()):
            store.flatten(0, 1)[slots] = 0
    expected = torch_reference(torch_batch)
    backend = TritonAttentionBackend(num_splits=num_splits)
    out = backend.forward(0, triton_batch.query, triton_batch.key, triton_batch.value, triton_batch.cache,
                          backend.build_metadata(triton_batch.inputs))
    if "q" not in k_type + v_type:
        for side in ("key_stores", "value_stores"):
            assert torch.equal(getattr(triton_batch.cache, side)[0]["values"],
                               getattr(torch_batch.cache, side)[0]["values"])
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    over_torch_bytes = backend.attend(0, torch_batch.query, torch_batch.cache,
                                      backend.build_metadata(torch_batch.inputs))
    torch.testing.assert_close(over_torch_bytes, expected, atol=2e-5, rtol=1e-4)
