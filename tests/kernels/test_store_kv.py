"""store_kv against the torch codecs' writes (PagedKVCache.write) into the same pool layout.

Plain formats: the stored bytes are identical. Quantized formats: a vector's bytes may differ only where
float rounding decides a tie (a code at a rounding boundary, two equally good scales, a mean choice at
equal norms), and then its reconstruction error is no worse than the torch codec's.
"""

from __future__ import annotations

import pytest
import torch
from localserve.kernels.kv_format import KVStore
from localserve.kernels.store_kv import store_kv

from localserve.attention.triton_backend import kv_store
from localserve.kv.codecs import Q4Codec, Q8Codec
from tests.helpers.kv_pools import DEVICE, keys_at, make_cache, rope_fn, values_near_mean

NUM_BLOCKS = 6


def write_both(k_type: str, v_type: str, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_tokens: int):
    """The same tokens written by the torch codecs and by store_kv into two fresh pools.

    store_kv also gets a few extra rows with slot -1, which must land nowhere.
    """
    torch_cache, triton_cache = (make_cache(k_type, v_type, num_kv_heads, head_dim, NUM_BLOCKS, dtype)
                                 for _ in range(2))
    positions = torch.randint(0, 3000, (num_tokens,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    key = keys_at(positions.cpu(), num_kv_heads, head_dim, seed=2).to(dtype)
    value = values_near_mean(num_tokens, num_kv_heads, head_dim, seed=3).to(dtype)
    slots = torch.randperm(NUM_BLOCKS * 16, generator=torch.Generator().manual_seed(4))[:num_tokens].to(DEVICE)
    torch_cache.write(0, key, value, slots, positions)
    skipped = torch.full((3,), -1, device=DEVICE)
    cos, sin = rope_fn(head_dim)(torch.cat((positions, skipped + 1)))
    trig = torch.cat((cos[:, :head_dim // 2], sin[:, :head_dim // 2]), dim=-1)
    for x, codecs, stores in ((key, triton_cache.key_codecs, triton_cache.key_stores),
                              (value, triton_cache.value_codecs, triton_cache.value_stores)):
        garbage = torch.full((3, num_kv_heads, head_dim), 1e4, device=DEVICE, dtype=dtype)
        store_kv(torch.cat((x, garbage)), torch.cat((slots, skipped)), kv_store(stores[0]),
                 codecs[0].kernel_format(torch.device(DEVICE)), trig)
    return torch_cache, triton_cache, key, value, slots, positions


def tie_values(num: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """fp32 values exactly halfway between two bf16 values (odd and even), where rounding modes differ."""
    index = torch.arange(num * num_kv_heads * head_dim, dtype=torch.int32)
    bf16_bits = 0x3000 + (index * 97) % 0x2000 + (index % 2) * 0x8000  # finite, both signs, odd and even
    return ((bf16_bits << 16) | 0x8000).view(torch.float32).view(num, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype,k_type,v_type,num_kv_heads,head_dim", [
    (torch.float32, "fp16", "bf16", 2, 64),
    (torch.float32, "bf16", "fp32", 3, 128),
    (torch.bfloat16, "fp32", "fp16", 2, 128),
    (torch.float16, "bf16", "bf16", 1, 64),
])
def test_plain_formats_store_identical_bytes(dtype, k_type, v_type, num_kv_heads, head_dim):
    torch_cache, triton_cache, *_ = write_both(k_type, v_type, num_kv_heads, head_dim, dtype, 37)
    for side in ("key_stores", "value_stores"):
        assert torch.equal(getattr(triton_cache, side)[0]["values"], getattr(torch_cache, side)[0]["values"])


def test_bf16_rounds_half_to_even_like_torch():
    x = tie_values(20, 2, 64)
    cache = make_cache("bf16", "bf16", 2, 64, 2)
    slots = torch.arange(20, device=DEVICE)
    store = kv_store(cache.key_stores[0])
    store_kv(x.to(DEVICE), slots, store, cache.key_codecs[0].kernel_format(torch.device(DEVICE)))
    assert torch.equal(store.data.view(-1, 2, 64)[:20], x.to(DEVICE, torch.bfloat16))


def stored_domain(codec, x: torch.Tensor) -> torch.Tensor:
    """The exact vectors [T, Hkv, D] in the domain the codec quantizes in."""
    x = x.float()
    if isinstance(codec, Q8Codec):
        return x @ codec.rotation.to(x.device).T if codec.rotated else x
    return torch.einsum("ged,tgd->tge", codec.encode_matrix.to(x.device), x)


@pytest.mark.parametrize("k_type,v_type,num_kv_heads,head_dim,dtype", [
    ("q8_0", "q4_rot", 2, 64, torch.float32),
    ("q4_rot", "q8_0:-rotation", 2, 128, torch.bfloat16),
    ("q4_rot:-codebook", "q4_rot:-mean", 1, 64, torch.float32),
    ("q4_rot:-rotation", "q4_rot:-codebook,-rotation", 3, 64, torch.float16),
    ("q4_rot:-key_transform", "q8_0", 1, 128, torch.float32),
    # heads wider than 128: the rotation and the key mean's rotation to each position done in torch first
    ("q4_rot", "q8_0", 1, 256, torch.bfloat16),
    ("q8_0", "q4_rot", 1, 512, torch.float32),
    ("q4_rot", "q4_rot", 1, 512, torch.float32),
])
def test_quantized_formats_match_torch_codecs_up_to_ties(k_type, v_type, num_kv_heads, head_dim, dtype):
    num_tokens = 64
    torch_cache, triton_cache, key, value, slots, positions = write_both(k_type, v_type, num_kv_heads, head_dim,
                                                                          dtype, num_tokens)
    for side, x in (("key", key), ("value", value)):
        codec = getattr(torch_cache, f"{side}_codecs")[0]
        expected = getattr(torch_cache, f"{side}_stores")[0]
        actual = getattr(triton_cache, f"{side}_stores")[0]
        written = torch.zeros(NUM_BLOCKS * 16, dtype=torch.bool, device=DEVICE)
        written[slots] = True
        for name in expected:  # the skipped rows (slot -1) landed nowhere
            assert not actual[name].flatten(0, 1)[~written].any()
        rows = {name: (expected[name].flatten(0, 1)[slots], actual[name].flatten(0, 1)[slots]) for name in expected}
        per_vector = [(a != b).flatten(2).any(-1) if a.dim() > 2 else (a != b) for a, b in rows.values()]
        differs = torch.stack(per_vector).any(0)  # [T, Hkv]
        assert differs.float().mean() <= 0.03, f"{side}: {int(differs.sum())} vectors differ"
        if isinstance(codec, Q8Codec):
            codes_expected, codes_actual = rows["codes"]
            assert (codes_expected.int() - codes_actual.int()).abs().max() <= 1
        truth = stored_domain(codec, x)
        errors = []
        for stored in ({n: e for n, (e, _) in rows.items()}, {n: a for n, (_, a) in rows.items()}):
            decoded = codec.decode(stored, positions).float()
            errors.append((decoded - truth).pow(2).sum(-1))
        torch_error, kernel_error = errors
        assert bool((kernel_error <= torch_error * 1.001 + 1e-6 * truth.pow(2).sum(-1)).all()), side
        if isinstance(codec, Q4Codec) and codec.mean is not None:
            assert torch.signbit(rows["scales"][1]).any()  # the mean is used somewhere, so the bit was tested


def test_store_rejects_a_layout_it_cannot_index():
    cache = make_cache("q8_0", "fp16", 2, 64, 2)
    fmt = cache.key_codecs[0].kernel_format(torch.device(DEVICE))
    x = torch.zeros(4, 2, 64, device=DEVICE)
    codes = cache.key_stores[0]["codes"]
    with pytest.raises(ValueError, match="scales"):
        store_kv(x, torch.arange(4, device=DEVICE), KVStore(codes, None), fmt)
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(x, torch.arange(4, device=DEVICE), KVStore(codes.transpose(0, 1), cache.key_stores[0]["scales"]),
                 fmt)
    odd_cache = make_cache("fp16", "fp16", 1, 48, 2)
    with pytest.raises(ValueError, match="power of two >= 16, got 48"):
        store_kv(torch.zeros(4, 1, 48, device=DEVICE), torch.arange(4, device=DEVICE),
                 kv_store(odd_cache.key_stores[0]), odd_cache.key_codecs[0].kernel_format(torch.device(DEVICE)))
