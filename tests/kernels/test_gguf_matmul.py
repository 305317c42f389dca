"""The GGUF weight kernels against the `gguf` package's own dequantization of the same bytes.

Random valid blocks of every type the kernels read; products must equal x @ W^T with W from
`gguf.quants.dequantize` up to float32 rounding (each output's error bounded by a small multiple of
float32's epsilon times sum |x| |W| over its row), on shapes that are not multiples of the tiles (an odd
row count, rows of 7 legacy blocks or 3 K-quant blocks), at batch 1, 3 and 17, with each method and
both the device's own tiling and CUDA's (on a CPU the interpreter's differs; pairwise, not the full
product). Dequantized rows must be the reference's exactly.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.kernels.gguf_blocks import QUANT_FORMATS
from localserve.kernels.gguf_matmul import CUDA, choose_method, dequantize_rows, quantized_matmul

from tests.helpers.gguf import random_blocks
from tests.helpers.kv_pools import DEVICE

TYPES = list(QUANT_FORMATS)
NUM_ROWS = 37  # odd, and not a multiple of any tiling's rows per program
RELATIVE_TOLERANCE = 1e-6  # float32's epsilon is 6e-8; the errors seen are at most 2e-7


def weight(qtype: str, num_rows: int = NUM_ROWS, blocks: int | None = None, seed: int = 0):
    """(blocks on DEVICE, the reference W float64 [N, K], K) for random valid blocks of `qtype`."""
    fmt = QUANT_FORMATS[qtype]
    blocks = blocks or (3 if fmt.block_values == 256 else 7)
    in_features = blocks * fmt.block_values
    data = random_blocks(qtype, num_rows, in_features, seed=seed)
    reference = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
    assert reference.shape == (num_rows, in_features) and np.isfinite(reference).all()
    return torch.from_numpy(data).to(DEVICE), torch.from_numpy(reference).double(), in_features


def assert_matches_reference(out: torch.Tensor, x: torch.Tensor, reference_weight: torch.Tensor,
                             tolerance: float = RELATIVE_TOLERANCE) -> None:
    x = x.double().cpu()
    expected = x @ reference_weight.T
    bound = tolerance * (x.abs() @ reference_weight.abs().T) + 1e-30
    error = (out.double().cpu() - expected).abs()
    assert out.shape == expected.shape
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max().item():.2f}"


# Every type at batch 1 and 3 through gemv and at 17 through fused and scratch; the device's own tiling
# (None) and CUDA's alternate.
CASES = [(qtype, batch, method, (None, CUDA)[(index + position) % 2])
         for index, qtype in enumerate(TYPES)
         for position, (batch, method) in enumerate(((1, "gemv"), (3, "gemv"), (17, "fused"), (17, "scratch")))]


@pytest.mark.parametrize("qtype,batch,method,config", CASES,
                         ids=[f"{q}-{b}-{m}-{'cuda' if c is CUDA else 'device'}" for q, b, m, c in CASES])
def test_product_equals_matmul_with_gguf_dequantization(qtype, batch, method, config):
    blocks, reference_weight, in_features = weight(qtype, seed=batch)
    x = torch.randn(batch, in_features, generator=torch.Generator().manual_seed(batch)).to(DEVICE)
    out = quantized_matmul(x, blocks, QUANT_FORMATS[qtype], in_features, method=method, config=config)
    assert out.dtype == torch.float32
    assert_matches_reference(out, x, reference_weight)


@pytest.mark.parametrize("qtype", TYPES)
def test_gathered_rows_equal_gguf_dequantization(qtype):
    """Embedding rows: repeated and unordered ids give the reference rows exactly; an id outside W a row
    of zeros (in bf16: the reference rounded as torch rounds)."""
    blocks, reference_weight, in_features = weight(qtype, seed=7)
    ids = torch.tensor([5, 0, 36, 5, 17, NUM_ROWS, -1], device=DEVICE)
    rows = dequantize_rows(blocks, QUANT_FORMATS[qtype], in_features, torch.float32, rows=ids)
    expected = reference_weight[ids[:5].cpu()].float()
    assert torch.equal(rows[:5].cpu(), expected)
    assert not rows[5:].any()
    in_bf16 = dequantize_rows(blocks, QUANT_FORMATS[qtype], in_features, torch.bfloat16, rows=ids[:5])
    assert torch.equal(in_bf16.cpu(), expected.bfloat16())


def test_whole_weight_with_cuda_tiling_equals_gguf_dequantization():
    """Several programs and tiles per row (CUDA's tiling), a tile overhanging the row's end."""
    blocks, reference_weight, in_features = weight("Q5_1", num_rows=70, blocks=9)
    full = dequantize_rows(blocks, QUANT_FORMATS["Q5_1"], in_features, torch.float32, config=CUDA)
    assert torch.equal(full.cpu(), reference_weight.float())


def test_bfloat16_activations():
    """The GPU's model dtype: x and the output in bf16, the products accumulated in float32."""
    blocks, reference_weight, in_features = weight("Q4_K", seed=3)
    x = torch.randn(6, in_features, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEVICE)
    for method in ("gemv", "fused", "scratch"):
        rows = 4 if method == "gemv" else 6
        out = quantized_matmul(x[:rows], blocks, QUANT_FORMATS["Q4_K"], in_features, method=method)
        assert out.dtype == torch.bfloat16
        assert_matches_reference(out, x[:rows], reference_weight, tolerance=2 ** -7)


def test_leading_dimensions_and_empty_operands():
    blocks, reference_weight, in_features = weight("Q8_0")
    x = torch.randn(2, 3, in_features).to(DEVICE)
    out = quantized_matmul(x, blocks, QUANT_FORMATS["Q8_0"], in_features)
    assert out.shape == (2, 3, NUM_ROWS)
    assert_matches_reference(out.reshape(6, -1), x.reshape(6, -1), reference_weight)
    assert quantized_matmul(x[:0], blocks, QUANT_FORMATS["Q8_0"], in_features).shape == (0, 3, NUM_ROWS)
    assert quantized_matmul(x, blocks[:0], QUANT_FORMATS["Q8_0"], in_features).shape == (2, 3, 0)
    no_rows = dequantize_rows(blocks[:0], QUANT_FORMATS["Q8_0"], in_features, torch.float32, rows=torch.tensor([0]))
    assert no_rows.shape == (1, in_features) and not no_rows.any()


def test_bad_arguments_are_clear_errors():
    blocks, _, in_features = weight("Q4_0")
    fmt = QUANT_FORMATS["Q4_0"]
    x = torch.randn(1, in_features).to(DEVICE)
    with pytest.raises(ValueError, match="take 126 bytes, the blocks have 108"):
        quantized_matmul(x, blocks[:, :108].contiguous(), fmt, in_features)
    with pytest.raises(ValueError, match="uint8"):
        quantized_matmul(x, blocks.to(torch.int16), fmt, in_features)
    with pytest.raises(ValueError, match="x has 64 features, the weight 224"):
        quantized_matmul(x[:, :64], blocks, fmt, in_features)
    with pytest.raises(ValueError, match="multiple of 32 values, not 200"):
        fmt.row_bytes(200)
    with pytest.raises(ValueError, match="gemv takes at most 4 rows"):
        quantized_matmul(torch.randn(5, in_features).to(DEVICE), blocks, fmt, in_features, method="gemv")
    with pytest.raises(ValueError, match="unknown method 'cublas'"):
        quantized_matmul(x, blocks, fmt, in_features, method="cublas")


@settings(max_examples=12, deadline=None)
@given(qtype=st.sampled_from(TYPES), num_rows=st.integers(1, 40), blocks=st.integers(1, 4),
       batch=st.integers(1, 9), method=st.sampled_from(["auto", "gemv", "fused", "scratch"]),
       cuda_tiling=st.booleans(), seed=st.integers(0, 2**16))
def test_generated_products(qtype, num_rows, blocks, batch, method, cuda_tiling, seed):
    """Generated shapes, batches, methods and tilings against the reference."""
    if method == "gemv":
        batch = min(batch, 4)
    weight_blocks, reference_weight, in_features = weight(qtype, num_rows, blocks, seed)
    x = torch.randn(batch, in_features, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    out = quantized_matmul(x, weight_blocks, QUANT_FORMATS[qtype], in_features,
                           method=None if method == "auto" else method, config=CUDA if cuda_tiling else None)
    assert_matches_reference(out, x, reference_weight)


def test_method_by_batch_and_size():
    """CUDA: gemv for decode batches, fused above, scratch for prefill unless the scratch would be huge."""
    assert [choose_method(batch, 4096 * 4096, CUDA) for batch in (1, 4, 5, 127, 128)] == [
        "gemv", "gemv", "fused", "fused", "scratch"]
    assert choose_method(512, 128256 * 4096, CUDA) == "fused"  # an 8B output layer: 1 GiB of bf16 scratch


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the reference's infinities
def test_mxfp4_exponents_at_their_limits_equal_gguf_dequantization():
    """E8M0 scales 2^-128 and 2^-127 (float32 subnormals), 2^-1, and 2^126 and 2^127 (where 12 codes
    overflow to infinity, as in the reference), with every code of both signs."""
    exponents = np.array([0, 1, 127, 254, 255], dtype=np.uint8)
    data = np.zeros((len(exponents), 2, 17), dtype=np.uint8)
    data[:, :, 0] = exponents[:, None]
    data[:, :, 1:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    data = data.reshape(len(exponents), 34)
    reference = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4))
    assert torch.isinf(reference).any() and (reference[0] != 0).any()
    rows = dequantize_rows(torch.from_numpy(data).to(DEVICE), QUANT_FORMATS["MXFP4"], 64, torch.float32)
    assert torch.equal(rows.cpu(), reference)
