"""paged_attention against the torch backend over the same stored bytes (Triton's interpreter on a CPU).

Cases are chosen pairwise over batch shape, head ratio, head dim, K and V formats, split-KV and dtype
rather than as their full product, so that the interpreter runs stay short.
"""

from __future__ import annotations

import pytest
import torch
from localserve.kernels.attention_plan import plan_attention
from localserve.kernels.paged_attention import paged_attention
from localserve.kernels.rotary import apply_rope

from localserve.attention.triton_backend import TritonAttentionBackend, kv_store
from tests.helpers.kv_pools import DEVICE, calibration, fill_batch, rope_fn, torch_reference

MIXED = [(1, 1328), (5, 18), (129, 463)]  # a long decode, a short chunk, a long chunk mid-prompt
SMALL_MIXED = [(1, 70), (7, 7), (1, 33), (20, 52)]

# (shapes, (H, Hkv), D, K format, V format, num_splits, dtype)
CASES = [
    (MIXED, (8, 1), 64, "fp16", "fp16", 1, torch.float32),
    (MIXED, (9, 3), 128, "q4_rot", "q4_rot", 1, torch.float32),
    (MIXED, (8, 2), 64, "q8_0", "q4_rot", 4, torch.float32),
    (MIXED, (2, 2), 128, "bf16", "q8_0", 3, torch.bfloat16),
    (SMALL_MIXED, (4, 1), 128, "q4_rot", "q8_0", 2, torch.bfloat16),
    (SMALL_MIXED, (9, 3), 64, "fp32", "bf16", 3, torch.float32),
    (SMALL_MIXED, (2, 2), 64, "q8_0:-rotation", "fp16", 1, torch.bfloat16),
    (SMALL_MIXED, (8, 1), 128, "q4_rot:-codebook,-key_transform", "q4_rot:-mean", 1, torch.float32),
    (SMALL_MIXED, (4, 1), 64, "q4_rot:-rotation", "q4_rot:-rotation", 2, torch.float32),
    (SMALL_MIXED, (8, 2), 128, "fp16", "q4_rot", 1, torch.float16),
]


def case_id(case) -> str:
    shapes, (heads, kv_heads), dim, k_type, v_type, splits, dtype = case
    name = "mixed" if shapes is MIXED else "small"
    return f"{name}-{heads}:{kv_heads}-d{dim}-{k_type}-{v_type}-split{splits}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_attention_matches_torch_backend(case):
    shapes, (num_heads, num_kv_heads), head_dim, k_type, v_type, num_splits, dtype = case
    batch = fill_batch(shapes, k_type, v_type, num_heads, num_kv_heads, head_dim, dtype, seed=len(k_type))
    backend = TritonAttentionBackend(num_splits=num_splits)
    out = backend.attend(0, batch.query, batch.cache, backend.build_metadata(batch.inputs))
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, torch_reference(batch), atol=2e-5, rtol=1e-4)
    else:  # half precision: no further from the exact (fp32) result than the torch backend in that dtype
        exact = torch_reference(batch, torch.float32)
        kernel_error = relative_error(out, exact)
        assert kernel_error < 1e-2
        assert kernel_error <= 1.25 * relative_error(torch_reference(batch), exact) + 5e-4


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.float() - exact).norm() / exact.norm()).item()


def direct_attention(batch, plan, query=None, block_tables=None):
    """paged_attention on the batch's (plain-format) pool, bypassing the backend."""
    cache, layer = batch.cache, 0
    key_format = cache.key_codecs[layer].kernel_format(torch.device(DEVICE))
    value_format = cache.value_codecs[layer].kernel_format(torch.device(DEVICE))
    return paged_attention(batch.query if query is None else query, kv_store(cache.key_stores[layer]),
                           kv_store(cache.value_stores[layer]), key_format, value_format, plan,
                           batch.query.shape[-1] ** -0.5)


def test_padding_rows_tiles_and_table_entries_are_never_touched():
    """Padding query rows and padding tiles (a captured graph's fixed shapes) are skipped, and block-table
    entries past a sequence's blocks are never read: filling them with garbage changes nothing."""
    shapes = [(1, 40), (0, 17), (6, 21)]  # a sequence with no new token this step
    batch = fill_batch(shapes, "fp16", "fp16", 4, 2, 64)
    reference = torch_reference(batch)
    meta = batch.inputs
    padded_query = torch.cat((batch.query, torch.full((3, 4, 64), float("nan"), device=DEVICE)))
    garbage_tables = meta.block_tables.clone()
    for row, (_, context_len) in enumerate(shapes):
        garbage_tables[row, -(-context_len // 16):] = 2 ** 30
    for num_splits in (1, 2):
        plan = plan_attention(meta.query_lens, meta.context_lens, garbage_tables, 4, 2, num_splits=num_splits,
                              num_tiles=9)
        assert int((plan.tile_seq < 0).sum()) == 9 - 2
        out = torch.full_like(padded_query, 7.0)
        out = paged_attention(padded_query, *[kv_store(s[0]) for s in (batch.cache.key_stores,
                                                                        batch.cache.value_stores)],
                              *[c[0].kernel_format(torch.device(DEVICE)) for c in (batch.cache.key_codecs,
                                                                                     batch.cache.value_codecs)],
                              plan, 64 ** -0.5, output=out)
        torch.testing.assert_close(out[:7], reference, atol=2e-5, rtol=1e-4)
        assert bool((out[7:] == 7.0).all())


def test_forward_writes_the_same_bytes_and_attends_like_torch():
    """The full backend step (store_kv, then attention) on plain formats: stored bytes are identical."""
    shapes = [(1, 50), (12, 30)]
    reference_batch = fill_batch(shapes, "bf16", "fp16", 4, 2, 64, seed=3)
    triton_batch = fill_batch(shapes, "bf16", "fp16", 4, 2, 64, seed=3)
    for cache in (reference_batch.cache, triton_batch.cache):  # forget the step's tokens, so forward writes them
        for store in (*cache.key_stores[0].values(), *cache.value_stores[0].values()):
            store.view(-1, *store.shape[2:])[reference_batch.inputs.slot_mapping] = 0
    expected = torch_reference(reference_batch)
    backend = TritonAttentionBackend()
    out = backend.forward(0, triton_batch.query, triton_batch.key, triton_batch.value, triton_batch.cache,
                          backend.build_metadata(triton_batch.inputs))
    for side in ("key_stores", "value_stores"):
        assert torch.equal(getattr(triton_batch.cache, side)[0]["values"],
                           getattr(reference_batch.cache, side)[0]["values"])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_plan_covers_every_query_once_and_splits_long_decodes():
    query_lens, seq_lens = [1, 0, 37, 5], [900, 4, 60, 5]
    tables = torch.zeros(4, 60, dtype=torch.int64)
    plan = plan_attention(query_lens, seq_lens, tables, 9, 3, block_m=16)  # 5 queries of 3 heads per tile
    covered = [0] * 4
    for seq, start in zip(plan.tile_seq.tolist(), plan.tile_start.tolist()):
        covered[seq] += min(5, query_lens[seq] - start)
    assert covered == query_lens
    assert plan.query_start.tolist() == [0, 1, 1, 38, 43] and plan.num_splits == 1
    decode = plan_attention([1, 1], [8000, 300], tables[:2], 32, 8, num_sms=132)
    assert decode.block_m == 16 and 1 < decode.num_splits <= 16
    assert plan_attention([1] * 64, [8000] * 64, torch.zeros(64, 1), 32, 8, num_sms=132).num_splits == 1
    with pytest.raises(ValueError, match="query_len"):
        plan_attention([5], [4], tables[:1], 4, 2)


def test_mean_flag_is_the_sign_bit_even_at_zero_scale():
    """Keys and values exactly at their mean store a scale of -0.0: the mean is used, and `< 0` would miss it."""
    batch = fill_batch([(1, 40), (3, 20)], "q4_rot", "q4_rot", 4, 2, 64, seed=9)
    cache, meta = batch.cache, batch.inputs
    layer_calibration = calibration(2, 64)
    positions = torch.tensor([3, 4, 5, 16], device=DEVICE)  # of the second sequence, before its new tokens (17-19)
    table = meta.block_tables[1]
    slots = table[positions // 16] * 16 + positions % 16
    cos, sin = rope_fn(64)(positions)
    at_mean_keys = apply_rope(layer_calibration.key_mean.to(DEVICE).expand(4, -1, -1), cos, sin)
    cache.write(0, at_mean_keys, layer_calibration.value_mean.to(DEVICE).expand(4, -1, -1), slots, positions)
    for store in (cache.key_stores[0], cache.value_stores[0]):
        scales = store["scales"].flatten(0, 1)[slots]
        assert bool((torch.signbit(scales) & (scales == 0)).any())  # -0.0 is there
    backend = TritonAttentionBackend()
    out = backend.attend(0, batch.query, cache, backend.build_metadata(meta))
    torch.testing.assert_close(out, torch_reference(batch), atol=2e-5, rtol=1e-4)
