"""KV formats against straightforward reference quantizers; the paged cache and attention through them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from localserve.kernels.rotary import apply_rope
from localserve.models.config import RopeConfig
from localserve.models.layers.rotary import RotaryEmbedding

from localserve.attention.base import AttentionInputs
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.kv.cache import PagedKVCache
from localserve.kv.calibration import LayerCalibration
from localserve.kv.codecs import make_codec as make_spec_codec
from localserve.kv.formats import FORMAT_NAMES, KVFormatSpec, Q4Options
from localserve.kv.quantization import LLOYD_MAX_16, pack_nibbles, rotation_matrix, unpack_nibbles

HKV, D = 2, 64


def make_codec(name: str, *args):
    """The codec of the format `name` (the codecs take a parsed spec)."""
    return make_spec_codec(KVFormatSpec.parse(name), *args)


def bits_per_value(name: str, head_dim: int) -> float:
    return KVFormatSpec.parse(name).bits_per_value(head_dim)


def rope_fn(head_dim: int = D):
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim)
    return lambda positions: rotary(positions, torch.float32)


def gaussian(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def to_true_domain(codec, decoded: torch.Tensor) -> torch.Tensor:
    """Map decoded vectors [N, Hkv, D] back from the codec's stored domain."""
    if not codec.rotated:
        return decoded.float()
    if codec.name == "q8_0":
        return decoded @ codec.rotation
    return torch.einsum("gde,tge->tgd", torch.linalg.inv(codec.encode_matrix), decoded)


# ---------------------------------------------------------------- references
def reference_q8_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp's q8_0, one block of 32 at a time: d = amax/127 in fp16, q = round(x/d)."""
    out = np.empty_like(x, dtype=np.float64)
    for start in range(0, x.size, 32):
        block = x[start:start + 32].astype(np.float64)
        d = float(np.float16(np.abs(block).max() / 127))
        q = np.clip(np.round(block / d), -127, 127) if d else np.zeros_like(block)
        out[start:start + 32] = q * d
    return out


def reference_hadamard(n: int) -> np.ndarray:
    if n == 1:
        return np.ones((1, 1))
    h = reference_hadamard(n // 2)
    return np.block([[h, h], [h, -h]])


def reference_q4_vector(y: np.ndarray, levels: np.ndarray, scales: list[float]) -> np.ndarray:
    """Best least-squares refit over candidate scales, codes by nearest level, one vector."""
    best, best_err = None, math.inf
    for s in scales:
        codes = np.abs(y[:, None] / s - levels[None, :]).argmin(1)
        c = levels[codes]
        fit = float(y @ c / (c @ c))
        err = float(((y - fit * c) ** 2).sum())
        if err < best_err:
            best, best_err = fit * c, err
    return best


# ---------------------------------------------------------------- formats
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_rotation_is_orthonormal(head_dim):
    r = rotation_matrix(head_dim).double()
    assert torch.allclose(r @ r.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-6)
    if head_dim & (head_dim - 1) == 0:  # random signs, then a normalised Hadamard
        signs = r[0] * math.sqrt(head_dim)
        expected = reference_hadamard(head_dim) * signs.numpy()[None, :] / math.sqrt(head_dim)
        assert np.allclose(r.numpy(), expected, atol=1e-6)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bits_per_value_formulas_and_storage(name, head_dim):
    expected = {"fp32": 32, "fp64": 64, "fp16": 16, "bf16": 16, "q8_0": 8.5,
                "q4_rot": 4 + 16 / head_dim}[name]
    assert bits_per_value(name, head_dim) == expected
    codec = make_codec(name, "value", 8, head_dim)
    assert codec.bytes_per_token() * 8 == expected * 8 * head_dim
    assert bits_per_value("q4_rot", 64) == 4.25 and bits_per_value("q4_rot", 128) == 4.125


def test_lloyd_max_codebook():
    # Published 16-level Gaussian Lloyd-Max levels, and each level is the centroid of its cell.
    known = [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326]
    assert torch.allclose(LLOYD_MAX_16[8:], torch.tensor(known), atol=2e-4)
    assert torch.allclose(LLOYD_MAX_16, -LLOYD_MAX_16.flip(0))
    samples = gaussian(400_000, seed=3)
    cells = torch.bucketize(samples, (LLOYD_MAX_16[1:] + LLOYD_MAX_16[:-1]) / 2)
    centroids = torch.stack([samples[cells == i].mean() for i in range(16)])
    assert torch.allclose(centroids, LLOYD_MAX_16, atol=0.03)


def test_nibble_packing_roundtrip():
    codes = torch.randint(0, 16, (5, 3, 64), generator=torch.Generator().manual_seed(0))
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 32)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert int(packed[0, 0, 0]) == int(codes[0, 0, 0]) | int(codes[0, 0, 1]) << 4


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_passthrough_roundtrip(name):
    x = gaussian(20, HKV, D)
    codec = make_codec(name, "key", HKV, D)
    out = codec.decode(codec.encode(x))
    tolerance = {"fp32": 0, "fp16": 2 ** -11, "bf16": 2 ** -8}[name]
    assert ((out.float() - x).abs() <= tolerance * x.abs()).all()


@pytest.mark.parametrize("rotation", [False, True])
def test_q8_0_matches_reference(rotation):
    x = gaussian(16, HKV, D) * torch.linspace(0.01, 30, D)  # blocks with very different ranges
    x[3, 1, :32] = 0  # an all-zero block
    codec = make_codec("q8_0" if rotation else "q8_0:-rotation", "key", HKV, D)
    assert codec.rotated == rotation
    stored = codec.decode(codec.encode(x)).double()
    y = x.double() @ rotation_matrix(D).double().T if rotation else x.double()  # what is quantized
    for t in range(x.shape[0]):
        for g in range(HKV):
            ref = reference_q8_0(y[t, g].numpy())
            assert np.allclose(stored[t, g].numpy(), ref, rtol=0, atol=1e-6 * np.abs(ref).max() + 1e-12)
    block_amax = y.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    error = (stored - y).abs().unflatten(-1, (-1, 32))
    assert (error <= block_amax / 127 / 2 * 1.002 + 1e-5).all()  # half a step (fp16-rounded scale)
    true = to_true_domain(codec, stored.float())
    assert ((true - x) ** 2).sum() / (x ** 2).sum() < 1e-4


def test_q8_0_rotation_spreads_outlier_channels():
    x = gaussian(64, HKV, D, seed=4)
    x[..., 5] += 40  # one outlier channel, as keys have
    errors = {}
    for spec in ("q8_0", "q8_0:-rotation"):
        codec = make_codec(spec, "key", HKV, D)
        errors[spec] = ((to_true_domain(codec, codec.decode(codec.encode(x))) - x) ** 2).sum().item()
    assert errors["q8_0"] < errors["q8_0:-rotation"] / 2


def test_q4_matches_reference_and_error_bound():
    x = gaussian(64, HKV, D, seed=1) * 3
    codec = make_codec("q4_rot:-mean,-key_transform", "value", HKV, D)
    decoded = codec.decode(codec.encode(x))
    r = rotation_matrix(D).double().numpy()
    levels = LLOYD_MAX_16.double().numpy()
    factors = np.exp(np.linspace(math.log(0.6), math.log(1.7), 16))
    for t in range(0, 64, 7):
        for g in range(HKV):
            y = r @ x[t, g].double().numpy()
            rms = float(np.sqrt((y ** 2).mean()))
            candidates = [rms * f for f in factors] + [np.abs(y).max() / levels.max()]
            ref = reference_q4_vector(y, levels, candidates)
            assert np.allclose(decoded[t, g].double().numpy(), ref, atol=2e-3 * np.abs(ref).max())
    true = to_true_domain(codec, decoded)
    relative_mse = ((true - x) ** 2).sum() / (x ** 2).sum()
    assert relative_mse < 0.0115  # Lloyd-Max for a Gaussian: 0.0095 at an ideal scale


@pytest.mark.parametrize("spec,bound", [("q4_rot:-rotation,-codebook", 0.03), ("q4_rot:-codebook", 0.03),
                                        ("q4_rot:-rotation", 0.02)])
def test_q4_ablations_roundtrip(spec, bound):
    x = gaussian(64, HKV, D, seed=2)
    codec = make_codec(spec, "value", HKV, D)
    true = to_true_domain(codec, codec.decode(codec.encode(x)))
    assert ((true - x) ** 2).sum() / (x ** 2).sum() < bound


def key_calibration(seed: int = 5) -> tuple[LayerCalibration, torch.Tensor]:
    """A calibration with a large key mean and a well-conditioned key transform; also that mean."""
    mean = gaussian(HKV, D, seed=seed) * 4 + 6
    transform = torch.eye(D) + 0.2 * gaussian(HKV, D, D, seed=seed + 1) / math.sqrt(D)
    return LayerCalibration(key_mean=mean, value_mean=mean.flip(-1), key_transform=transform), mean


def test_adaptive_key_mean_and_sign_bit():
    calibration, mean = key_calibration()
    rope = rope_fn()
    positions = torch.arange(40)
    x_pre = mean + gaussian(40, HKV, D, seed=7)
    x_pre[0] = gaussian(HKV, D, seed=8) * 0.5  # an attention-sink-like vector far from the mean
    cos, sin = rope(positions)
    x = apply_rope(x_pre, cos, sin)
    with_mean = make_codec("q4_rot", "key", HKV, D, calibration, rope)
    without = make_codec("q4_rot:-mean", "key", HKV, D, calibration, rope)
    stored = with_mean.encode(x, positions)
    used = torch.signbit(stored["scales"])
    assert not used[0].any() and used[1:].all()  # skipped where subtracting would grow the vector
    errors = []
    for codec in (with_mean, without):
        true = to_true_domain(codec, codec.decode(codec.encode(x, positions), positions))
        errors.append(((true - x) ** 2).sum().item())
    assert errors[0] < errors[1] / 4


def test_key_transform_preserves_scores():
    calibration, _ = key_calibration()
    rope = rope_fn()
    codec = make_codec("q4_rot", "key", HKV, D, calibration, rope)
    eye = torch.eye(D).expand(HKV, D, D)
    assert torch.allclose(codec.query_matrix.transpose(-1, -2) @ codec.encode_matrix, eye, atol=1e-4)
    positions = torch.arange(30)
    x = apply_rope(calibration.key_mean + gaussian(30, HKV, D, seed=9), *rope(positions))
    query = gaussian(30, 4 * HKV, D, seed=10)  # 4 query heads per KV head
    decoded = codec.decode(codec.encode(x, positions), positions)
    scores = torch.einsum("thd,shd->ths", codec.transform_query(query),
                          decoded.repeat_interleave(4, dim=1))
    exact = torch.einsum("thd,shd->ths", query, x.repeat_interleave(4, dim=1))
    assert ((scores - exact) ** 2).mean() / (exact ** 2).mean() < 0.01


def test_format_spec_parsing():
    assert KVFormatSpec.parse("q4_rot:-mean,-rotation").options == Q4Options(mean=False, rotation=False)
    assert KVFormatSpec.parse("F16").name == "fp16"
    assert KVFormatSpec.parse("q8_0:-rotation").options.rotation is False
    with pytest.raises(ValueError):
        KVFormatSpec.parse("q3_k")
    with pytest.raises(ValueError):
        KVFormatSpec.parse("q8_0:-mean")


def test_format_spec_canonical_text_and_calibration_need():
    assert str(KVFormatSpec.parse("Q4:-mean,+rotation")) == "q4_rot:-mean"
    assert str(KVFormatSpec.parse("q8_0:-rotation")) == "q8_0:-rotation"
    assert str(KVFormatSpec.parse("f16")) == "fp16" and KVFormatSpec.parse("f16") == KVFormatSpec("fp16")
    assert KVFormatSpec.parse("q4_rot").needs_calibration
    assert KVFormatSpec.parse("q4_rot:-mean").needs_calibration  # the key transform still is calibrated
    assert not KVFormatSpec.parse("q4_rot:-mean,-key_transform").needs_calibration
    assert not KVFormatSpec.parse("q8_0").needs_calibration and not KVFormatSpec.parse("bf16").needs_calibration
    assert KVFormatSpec.parse("bf16").dtype_name == "bfloat16" and KVFormatSpec.parse("q8_0").dtype_name is None


@pytest.mark.parametrize("name,head_dim,message", [("q8_0", 48, "q8_0 needs a head_dim divisible by 32, got 48"),
                                                   ("q4_rot", 63, "q4_rot needs an even head_dim, got 63")])
def test_a_format_refuses_a_head_dim_it_cannot_store(name, head_dim, message):
    with pytest.raises(ValueError, match=message):
        KVFormatSpec.parse(name).bytes_per_vector(head_dim)
    with pytest.raises(ValueError, match=message):
        make_codec(name, "key", HKV, head_dim)
    assert KVFormatSpec.parse("fp16").bytes_per_vector(head_dim) == 2 * head_dim


# ---------------------------------------------------------------- the paged cache and attention
def make_cache(cache_type_k, cache_type_v, num_blocks=12, num_cpu_blocks=0, layers=1):
    calibration, _ = key_calibration()

    class Calibration:
        def layer(self, index):
            return calibration

    return PagedKVCache(layers, num_blocks, 4, HKV, D, torch.float32, num_cpu_blocks=num_cpu_blocks,
                        key_format=KVFormatSpec.parse(cache_type_k), value_format=KVFormatSpec.parse(cache_type_v),
                        calibration=Calibration(), rope=rope_fn())


@pytest.mark.parametrize("k_type,v_type",
                         [("q4_rot", "q4_rot"), ("q8_0", "q4_rot"), ("q4_rot:-mean", "fp16")])
def test_attention_through_quantized_cache_equals_dequantized_reference(k_type, v_type):
    cache = make_cache(k_type, v_type)
    backend = TorchAttentionBackend()
    tables = [[7, 2, 9, 0], [5, 11, 3, 1]]
    lens = [13, 6]
    calibration, mean = key_calibration()
    rope = rope_fn()
    keys, values = [], []
    for seq, length in enumerate(lens):  # prefill each sequence
        pos = torch.arange(length)
        key = apply_rope(mean + gaussian(length, HKV, D, seed=20 + seq), *rope(pos))
        value = gaussian(length, HKV, D, seed=30 + seq) + 1
        keys.append(key)
        values.append(value)
        slots = torch.tensor([tables[seq][p // 4] * 4 + p % 4 for p in range(length)])
        meta = backend.build_metadata(AttentionInputs(slots, pos, torch.tensor([tables[seq]]), [length], [length], 4))
        backend.forward(0, gaussian(length, 4 * HKV, D, seed=40 + seq), key, value, cache, meta)
    # One batched decode step for both sequences.
    query = gaussian(2, 4 * HKV, D, seed=50)
    new_key = apply_rope(mean + gaussian(2, HKV, D, seed=51), *rope(torch.tensor(lens)))
    new_value = gaussian(2, HKV, D, seed=52)
    slots = torch.tensor([tables[s][lens[s] // 4] * 4 + lens[s] % 4 for s in range(2)])
    meta = backend.build_metadata(AttentionInputs(slots, torch.tensor(lens), torch.tensor(tables), [1, 1],
                                                  [n + 1 for n in lens], 4))
    out = backend.forward(0, query, new_key, new_value, cache, meta)
    # Reference: dequantize each sequence's blocks, un-rotate K and V, plain softmax attention.
    for seq in range(2):
        n = lens[seq] + 1
        key_store = {k: t[tables[seq]].flatten(0, 1)[:n] for k, t in cache.key_stores[0].items()}
        value_store = {k: t[tables[seq]].flatten(0, 1)[:n] for k, t in cache.value_stores[0].items()}
        positions = torch.arange(n)
        k_true = to_true_domain(cache.key_codecs[0], cache.key_codecs[0].decode(key_store, positions))
        v_true = to_true_domain(cache.value_codecs[0], cache.value_codecs[0].decode(value_store, positions))
        q = query[seq].view(HKV, 4, D)
        scores = torch.einsum("gjd,tgd->gjt", q, k_true) / math.sqrt(D)
        expected = torch.einsum("gjt,tgd->gjd", scores.softmax(-1), v_true).reshape(4 * HKV, D)
        assert torch.allclose(out[seq], expected, atol=1e-4)
        # And the quantized cache stays close to the exact values it was given.
        k_exact = torch.cat((keys[seq], new_key[seq:seq + 1]))
        assert ((k_true - k_exact) ** 2).sum() / (k_exact ** 2).sum() < 0.02


def test_copy_and_swap_move_stored_bytes():
    cache = make_cache("q4_rot", "q8_0", num_blocks=6, num_cpu_blocks=3)
    pos = torch.arange(8)
    key = apply_rope(key_calibration()[1] + gaussian(8, HKV, D, seed=60), *rope_fn()(pos))
    cache.write(0, key, gaussian(8, HKV, D, seed=61), torch.arange(8) + 4, pos)  # blocks 1 and 2
    snapshot = {k: [t.clone() for t in store.values()] for k, store in
                (("k", cache.key_stores[0]), ("v", cache.value_stores[0]))}
    cache.swap_out([(1, 0, 0), (2, 2, 0)])
    for store in (cache.key_stores[0], cache.value_stores[0]):
        for tensor in store.values():
            tensor.zero_()
    cache.swap_in([(0, 4, 0), (2, 5, 0)])
    cache.copy_blocks([(4, 1, 0), (5, 2, 0)])
    for name, store in (("k", cache.key_stores[0]), ("v", cache.value_stores[0])):
        for before, after in zip(snapshot[name], store.values(), strict=True):
            assert torch.equal(before[1:3], after[1:3]) and torch.equal(before[1:3], after[4:6])
    assert cache.bytes_per_token() == D * HKV * (4.25 + 8.5) / 8


# ---------------------------------------------------------------- calibration
def test_key_transform_solves_the_geometric_mean_equation():
    from localserve.kv.calibration import _shrink, key_transform_from_moments

    basis = gaussian(HKV, D, D, seed=70)
    key_moment = basis @ basis.transpose(-1, -2) / D + 0.1 * torch.eye(D)
    basis = gaussian(HKV, D, D, seed=71) * torch.linspace(0.1, 3, D)
    query_moment = basis @ basis.transpose(-1, -2) / D + 0.1 * torch.eye(D)
    a = key_transform_from_moments(key_moment, query_moment).double()
    m = a.transpose(-1, -2) @ a
    ck, cq = _shrink(key_moment.double()), _shrink(query_moment.double())
    # M Ck M is proportional to Cq (A is rescaled to keep the key energy).
    lhs = m @ ck @ m
    ratio = torch.diagonal(lhs, dim1=-2, dim2=-1).sum(-1) / torch.diagonal(cq, dim1=-2, dim2=-1).sum(-1)
    assert torch.allclose(lhs, cq * ratio[:, None, None], rtol=1e-3, atol=1e-6 * float(lhs.abs().max()))
    energy = torch.diagonal(a @ ck @ a.transpose(-1, -2), dim1=-2, dim2=-1).sum(-1)
    assert torch.allclose(energy, torch.diagonal(ck, dim1=-2, dim2=-1).sum(-1), rtol=1e-4)


def test_calibration_is_computed_once_and_cached(tiny_model_dir, tmp_path):
    from localserve.engine.kv_calibration import load_or_calibrate
    from localserve.loading.hf import load_model

    folder, _ = tiny_model_dir("llama")
    model = load_model(folder, dtype=torch.float32).model
    first = load_or_calibrate(model, None, cache_folder=tmp_path)
    config = model.config
    assert first.key_mean.shape == (config.num_layers, config.num_kv_heads, config.head_dim)
    shape = (config.num_layers, config.num_kv_heads, config.head_dim)
    assert first.key_transform.shape == (*shape, config.head_dim)
    assert all(torch.isfinite(t).all() for t in first.to_dict().values())
    assert len(list(tmp_path.glob("*.pt"))) == 1
    again = load_or_calibrate(model, None, cache_folder=tmp_path)
    pairs = zip(first.to_dict().values(), again.to_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


# ---------------------------------------------------------------- the engine end to end (SmolLM2)
ENGINE_FORMATS = [(None, None), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q4_rot", "q4_rot"), ("q8_0", "q4_rot")]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from localserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_path(smollm2_path)


@pytest.mark.parametrize("k_type,v_type", ENGINE_FORMATS)
def test_engine_serves_each_format(smollm2, smollm2_tokenizer, k_type, v_type):
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from localserve.engine.sampling_params import SamplingParams

    engine = build_engine(smollm2.model, smollm2_tokenizer,
                       EngineConfig(num_kv_blocks=16, cache_type_k=k_type, cache_type_v=v_type))
    prompt = smollm2_tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    max_tokens = 10 if k_type in (None, "q8_0") and k_type == v_type else 4
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    output = engine.run_to_completion()[request_id].outputs[0]
    assert len(output.token_ids) >= 1 and output.text
    if max_tokens == 10:
        assert "Paris" in output.text
