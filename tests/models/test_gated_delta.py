"""The gated delta rule (models/layers/gated_delta.py): the chunked form against the token-by-token one on
generated shapes and gates, both against transformers' Qwen3-Next torch reference, a sequence split at
arbitrary points with the state carried, and fixed examples at the chunk's limits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.models.layers.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)


def make_inputs(seed: int, batch: int, length: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int,
                gate: str = "mixed", dtype: torch.dtype = torch.float64, with_state: bool = True):
    """Random q, k, v, g, beta and an initial state; `gate` puts the decay exp(g) near 1 ("near1": g near 0),
    near 0 ("near0": g very negative) or anywhere in between ("mixed")."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, k_heads, k_dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, length, k_heads, k_dim, generator=gen, dtype=dtype) / k_dim ** 0.5
    v = torch.randn(batch, length, v_heads, v_dim, generator=gen, dtype=dtype)
    u = torch.rand(batch, length, v_heads, generator=gen, dtype=dtype)
    g = {"near1": -1e-4 * u, "near0": -30.0 - 50.0 * u, "mixed": -4.0 * u}[gate]
    beta = torch.rand(batch, length, v_heads, generator=gen, dtype=dtype)
    state = torch.randn(batch, v_heads, k_dim, v_dim, generator=gen, dtype=dtype) if with_state else None
    return q, k, v, g, beta, state


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 2), length=st.integers(1, 200),
    k_heads=st.integers(1, 2), group=st.integers(1, 2), k_dim=st.sampled_from([1, 4, 8]),
    v_dim=st.sampled_from([1, 3, 8]), chunk=st.sampled_from([1, 2, 7, 16, 64, 256]),
    gate=st.sampled_from(["near1", "near0", "mixed"]), l2norm=st.booleans(), with_state=st.booleans(),
)
def test_chunked_equals_recurrent(seed, batch, length, k_heads, group, k_dim, v_dim, chunk, gate, l2norm,
                                  with_state):
    q, k, v, g, beta, state = make_inputs(seed, batch, length, k_heads, k_heads * group, k_dim, v_dim, gate,
                                          with_state=with_state)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state, l2norm_qk=l2norm)
    got, got_state = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk, l2norm_qk=l2norm)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_state, want_state, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_compute_in_fp32(dtype):
    q, k, v, g, beta, state = make_inputs(3, 1, 70, 2, 2, 8, 8, dtype=dtype)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    got, got_state = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    assert got.dtype == dtype and got_state.dtype == torch.float32
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got_state, want_state, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(("length", "chunk", "l2norm", "heads"),
                         [(1, 64, False, (2, 2)), (37, 16, True, (1, 2)), (64, 64, True, (2, 4)),
                          (65, 64, False, (2, 2)), (130, 32, True, (2, 2))])
def test_matches_transformers(length, chunk, l2norm, heads):
    q, k, v, g, beta, state = make_inputs(length, 2, length, heads[0], heads[1], 8, 6, dtype=torch.float32)
    ref, ref_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    ref_chunk, ref_chunk_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=chunk, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm)
    for ours, ours_state in (recurrent_gated_delta_rule(q, k, v, g, beta, state, l2norm_qk=l2norm),
                             chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk, l2norm_qk=l2norm)):
        for want, want_state in ((ref, ref_state), (ref_chunk, ref_chunk_state)):
            torch.testing.assert_close(ours, want, rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(ours_state, want_state, rtol=2e-5, atol=2e-5)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), length=st.integers(2, 150),
       cuts=st.lists(st.floats(0, 1), min_size=1, max_size=4), chunk=st.sampled_from([1, 5, 16, 64]))
def test_split_prefill_carries_the_state(seed, length, cuts, chunk):
    q, k, v, g, beta, state = make_inputs(seed, 1, length, 2, 2, 4, 4)
    once, once_state = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
    points = sorted({0, length, *(min(length - 1, max(1, round(c * length))) for c in cuts)})
    pieces = []
    for start, stop in zip(points, points[1:]):
        part = slice(start, stop)
        out, state = chunked_gated_delta_rule(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part],
                                              state, chunk_size=chunk)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), once, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(state, once_state, rtol=1e-9, atol=1e-9)
    # decode after the prefill: one token at a time from the carried state
    step, step_state = recurrent_gated_delta_rule(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta[:, -1:],
                                                  state)
    again, again_state = chunked_gated_delta_rule(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta[:, -1:],
                                                  once_state, chunk_size=chunk)
    torch.testing.assert_close(step, again, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(step_state, again_state, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 32, 33])
def test_chunk_limits(length):
    """Length 1, one short of a chunk, a chunk, one past it, two chunks, one past them (chunk 16)."""
    q, k, v, g, beta, state = make_inputs(length, 2, length, 2, 2, 8, 8)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    got, got_state = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_state, want_state, rtol=1e-10, atol=1e-10)


def test_one_token_by_hand():
    """One head, Dk = Dv = 1: S1 = a S0 + k beta (v - a S0 k), o = S1 q / sqrt(1)."""
    s0, a, kk, vv, b, qq = 2.0, 0.5, 3.0, 5.0, 0.25, 7.0
    s1 = a * s0 + kk * b * (vv - a * s0 * kk)
    t = torch.tensor
    args = (t([[[[qq]]]]), t([[[[kk]]]]), t([[[[vv]]]]), t([[[a]]]).log(), t([[[b]]]), t([[[[s0]]]]))
    for rule in (recurrent_gated_delta_rule, chunked_gated_delta_rule):
        out, state = rule(*args)
        assert state.item() == pytest.approx(s1) and out.item() == pytest.approx(s1 * qq)


@pytest.mark.parametrize(("change", "message"), [
    ({"k": torch.zeros(1, 4, 2, 3)}, "query and key"),
    ({"v": torch.zeros(1, 4, 3, 5)}, "multiple of query/key heads"),
    ({"v": torch.zeros(1, 5, 2, 5)}, "value must be"),
    ({"g": torch.zeros(1, 4, 3)}, "g must be"),
    ({"beta": torch.zeros(1, 4)}, "beta must be"),
    ({"state": torch.zeros(1, 2, 5, 4)}, "initial_state must be"),
    ({"q": torch.zeros(1, 0, 2, 4), "k": torch.zeros(1, 0, 2, 4), "v": torch.zeros(1, 0, 2, 5),
      "g": torch.zeros(1, 0, 2), "beta": torch.zeros(1, 0, 2)}, "at least one token"),
])
def test_bad_input_is_named(change, message):
    args = {"q": torch.zeros(1, 4, 2, 4), "k": torch.zeros(1, 4, 2, 4), "v": torch.zeros(1, 4, 2, 5),
            "g": torch.zeros(1, 4, 2), "beta": torch.zeros(1, 4, 2), "state": None} | change
    for rule in (recurrent_gated_delta_rule, chunked_gated_delta_rule):
        with pytest.raises(ValueError, match=message):
            rule(args["q"], args["k"], args["v"], args["g"], args["beta"], args["state"])
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_gated_delta_rule(*(torch.zeros(1, 4, 2, 4),) * 3, torch.zeros(1, 4, 2), torch.zeros(1, 4, 2),
                                 chunk_size=0)
