"""The fused mixture-of-experts kernels against moe_reference over the same weights.

Every expert type the kernels read (dense bf16, fp16, fp32; each GGUF block type, whose reference
weights are `gguf.quants.dequantize` of the same blocks), at batch 1, 7 and 64 with uneven loads (one
expert chosen by every token, one by none), through both methods (per token at 64 for one type only:
the interpreter takes seconds for it), with the device's tiling and CUDA's (several programs per matrix,
tiles overhanging the rows). In float32 (the interpreter's tl.dot runs in
float32) the outputs equal the reference's up to float32 rounding; in bf16 and fp16, up to the rounding
of the hidden activations and the output to that dtype. Shapes are small: the interpreter runs each
program as Python.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.kernels.fused_moe import (
    CUDA_MOE,
    METHODS,
    choose_moe_method,
    cuda_moe_config,
    fused_moe,
    moe_config,
    sort_by_expert,
)
from localserve.kernels.gguf_blocks import QUANT_FORMATS
from localserve.kernels.gguf_matmul import INTERPRETER
from localserve.kernels.moe_experts import ExpertMatrix, Experts, moe_reference

from tests.helpers.kv_pools import DEVICE
from tests.helpers.moe import DENSE_TYPES, expert_shape, random_experts, uneven_routes

TYPES = ["bf16", *QUANT_FORMATS]  # fp16 and fp32 dense experts: test_dense_dtypes
NUM_EXPERTS, TOP_K = 5, 2
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}  # of the output's largest


def activations(qtype: str, num_tokens: int, seed: int) -> torch.Tensor:
    hidden, _ = expert_shape(qtype)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed))
    return x.to(DENSE_TYPES.get(qtype, torch.float32))


def assert_equals_reference(out: torch.Tensor, x: torch.Tensor, reference_experts: Experts, ids: torch.Tensor,
                            weights: torch.Tensor) -> None:
    """out against moe_reference in float32 over the reference weights, the error measured against the
    largest output (a token's sum cancels: its own size says little of the rounding in it)."""
    expected = moe_reference(x.float().cpu(), reference_experts, ids, weights)
    assert out.shape == expected.shape and out.dtype == x.dtype
    error = (out.float().cpu() - expected).abs().max().item()
    assert error <= TOLERANCE[x.dtype] * expected.abs().max().item(), (error, expected.abs().max().item())


def run_case(qtype: str, num_tokens: int, method: str, config=None, seed: int = 0, biases: bool = False,
             **activation) -> None:
    """`activation`: the Experts' activation fields (activation, alpha, limit) where not SwiGLU's."""
    hidden, intermediate = expert_shape(qtype)
    experts, reference_experts = random_experts(qtype, NUM_EXPERTS, hidden, intermediate, seed, biases)
    experts, reference_experts = (dataclasses.replace(e, **activation) for e in (experts, reference_experts))
    ids, weights = uneven_routes(num_tokens, NUM_EXPERTS, TOP_K, seed)
    x = activations(qtype, num_tokens, seed)
    out = fused_moe(x.to(DEVICE), experts, ids.to(DEVICE), weights.to(DEVICE), method=method, config=config)
    assert_equals_reference(out, x, reference_experts, ids, weights)




def cuda_tiling_at_batch_1(qtype: str) -> bool:
    """CUDA's tiling (16 or 32 rows a program) in the batch-1 cases of the types of 32-value blocks; for a
    K-quant it takes the interpreter seconds (test_grouped_with_cuda_tiling has one)."""
    return qtype in DENSE_TYPES or QUANT_FORMATS[qtype].block_values == 32


# Every type through both methods at batch 1 and 7, grouped at 64; per token at 64 in
# test_per_token_at_batch_64 (the interpreter takes seconds for it).
CASES = [(qtype, batch, method, CUDA_MOE if batch == 1 and cuda_tiling_at_batch_1(qtype) else None)
         for qtype in TYPES for batch in (1, 7, 64) for method in METHODS
         if not (batch == 64 and method == "per_token")]


@pytest.mark.parametrize("qtype,batch,method,config", CASES,
                         ids=[f"{q}-{b}-{m}-{'cuda' if c else 'device'}" for q, b, m, c in CASES])
def test_fused_moe_equals_reference(qtype, batch, method, config):
    run_case(qtype, batch, method, config, seed=batch)


def test_per_token_at_batch_64():
    run_case("Q8_0", 64, "per_token", seed=64)


@pytest.mark.parametrize("qtype", ["fp32", "fp16"])
def test_dense_dtypes(qtype):
    for method in METHODS:
        run_case(qtype, 7, method, seed=3)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("qtype", ["bf16", "Q4_K"])
def test_gelu_experts(method, qtype):
    """GeGLU experts (Gemma 4's 26B-A4B): act = GELU's tanh form, against the reference's torch GELU."""
    hidden, intermediate = expert_shape(qtype)
    experts, reference_experts = random_experts(qtype, NUM_EXPERTS, hidden, intermediate, seed=11)
    experts = dataclasses.replace(experts, activation="gelu_tanh")
    reference_experts = dataclasses.replace(reference_experts, activation="gelu_tanh")
    ids, weights = uneven_routes(7, NUM_EXPERTS, TOP_K, seed=11)
    x = activations(qtype, 7, seed=11)
    out = fused_moe(x.to(DEVICE), experts, ids.to(DEVICE), weights.to(DEVICE), method=method)
    assert_equals_reference(out, x, reference_experts, ids, weights)
    silu = moe_reference(x.float(), dataclasses.replace(reference_experts, activation="silu"), ids, weights)
    assert (out.float().cpu() - silu).abs().max() > 2 * TOLERANCE[x.dtype] * silu.abs().max()  # not SiLU's


@pytest.mark.parametrize("method", METHODS)
def test_expert_biases(method):
    """Biases on gate, up and down (gpt-oss has them), dense and quantized."""
    run_case("bf16", 7, method, seed=5, biases=True)
    run_case("Q4_0", 7, method, seed=5, biases=True)


@pytest.mark.parametrize("method", METHODS)
def test_clamped_swiglu_of_gpt_oss(method):
    """gpt-oss's activation with biases, on dense and MXFP4 experts; a limit of 0.5 clamps most gate and up
    values (the kernels and the reference clamp alike), alpha not 1 (unlike silu)."""
    for qtype in ("bf16", "MXFP4"):
        run_case(qtype, 7, method, seed=9, biases=True, activation="clamped_swiglu", alpha=1.702, limit=0.5)


def test_grouped_with_cuda_tiling():
    """CUDA's grouped tiles (32 rows a program: several per matrix) and a K-quant."""
    run_case("Q6_K", 3, "grouped", CUDA_MOE, seed=11)


def test_mixed_formats_across_projections():
    """Q4_K_M's mix: gate and up Q4_K, down Q6_K (grouped); gate Q4_K, up Q5_K, down Q6_K (per token)."""
    q4, q4_reference = random_experts("Q4_K", NUM_EXPERTS, 256, 256, seed=1)
    q6, q6_reference = random_experts("Q6_K", NUM_EXPERTS, 256, 256, seed=2)
    q5, q5_reference = random_experts("Q5_K", NUM_EXPERTS, 256, 256, seed=3)
    ids, weights = uneven_routes(3, NUM_EXPERTS, TOP_K, seed=4)
    x = activations("Q4_K", 3, seed=4)
    for up, up_reference, method in ((q4, q4_reference, "grouped"), (q5, q5_reference, "per_token")):
        experts = Experts(q4.gate, up.up, q6.down)
        reference = Experts(q4_reference.gate, up_reference.up, q6_reference.down)
        out = fused_moe(x.to(DEVICE), experts, ids.to(DEVICE), weights.to(DEVICE), method=method)
        assert_equals_reference(out, x, reference, ids, weights)


def test_sort_by_expert_runs():
    """Each run holds one expert's pairs in token order, padded with T * k; runs past the last are -1;
    an expert chosen by none has no run."""
    ids = torch.tensor([[0, 2], [0, 3], [2, 0]])  # expert 1 chosen by none
    sorted_pairs, run_experts = sort_by_expert(ids, 4, 2)
    assert sorted_pairs.tolist()[:8] == [0, 2, 5, 6, 1, 4, 3, 6]
    assert run_experts.tolist()[:4] == [0, 0, 2, 3] and set(run_experts.tolist()[4:]) <= {-1}
    assert sorted_pairs.numel() == 2 * run_experts.numel() and set(sorted_pairs.tolist()[8:]) <= {6}


@settings(max_examples=6, deadline=None)
@given(qtype=st.sampled_from(["fp32", "bf16", "Q4_0", "Q5_1", "Q8_0", "MXFP4", "Q4_K"]),
       hidden_units=st.integers(1, 4), intermediate_units=st.integers(1, 4),
       num_experts=st.integers(1, 6), top_k=st.integers(1, 6), num_tokens=st.integers(1, 9),
       skew=st.sampled_from(["none", "popular", "popular-and-unused"]),
       method=st.sampled_from(["auto", *METHODS]), cuda_tiling=st.booleans(), seed=st.integers(0, 2**16))
def test_generated_batches(qtype, hidden_units, intermediate_units, num_experts, top_k, num_tokens, skew, method,
                           cuda_tiling, seed):
    """Generated sizes (dense: any; 32-value blocks: 1 to 4 blocks a row; K-quants: one), expert counts, k up
    to every expert, batches, loads, methods and tilings."""
    top_k = min(top_k, num_experts)
    popular = 0 if skew != "none" else None
    unused = -1 if skew == "popular-and-unused" and num_experts > top_k else None
    if popular is not None and unused is not None and num_experts == 1:
        unused = None
    block_values = 1 if qtype in DENSE_TYPES else QUANT_FORMATS[qtype].block_values
    units = {1: 13, 32: 32, 256: 256}[block_values]  # dense: sizes that are no power of two
    hidden = units * (hidden_units if block_values < 256 else 1)
    intermediate = units * (intermediate_units if block_values < 256 else 1)
    experts, reference_experts = random_experts(qtype, num_experts, hidden, intermediate, seed)
    ids, weights = uneven_routes(num_tokens, num_experts, top_k, seed, popular, unused)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(
        DENSE_TYPES.get(qtype, torch.float32))
    out = fused_moe(x.to(DEVICE), experts, ids.to(DEVICE), weights.to(DEVICE),
                    method=None if method == "auto" else method, config=CUDA_MOE if cuda_tiling else None)
    assert_equals_reference(out, x, reference_experts, ids, weights)


def test_reference_dequantizes_quantized_experts():
    """moe_reference over GGUF blocks equals it over their gguf.quants dequantization."""
    experts, reference_experts = random_experts("Q5_K", 3, 256, 256, seed=2)
    ids, weights = uneven_routes(4, 3, 2, seed=2)
    x = activations("Q5_K", 4, seed=2)
    out = moe_reference(x.to(DEVICE), experts, ids.to(DEVICE), weights.to(DEVICE))
    torch.testing.assert_close(out.cpu(), moe_reference(x, reference_experts, ids, weights), rtol=1e-5, atol=1e-5)


def test_method_by_batch():
    assert [choose_moe_method(batch, CUDA_MOE) for batch in (1, 8, 9, 64)] == [
        "per_token", "per_token", "grouped", "grouped"]
    assert moe_config(torch.device("cpu")).tiles is INTERPRETER
    assert cuda_moe_config(9) is CUDA_MOE and cuda_moe_config(8).max_block_m == 32


def test_empty_batch():
    experts, _ = random_experts("Q8_0", 3, 64, 96)
    for method in METHODS:
        out = fused_moe(torch.zeros(0, 64, device=DEVICE), experts, torch.zeros(0, 2, dtype=torch.int64, device=DEVICE),
                        torch.zeros(0, 2, device=DEVICE), method=method)
        assert out.shape == (0, 64)


def test_bad_arguments_are_clear_errors():
    experts, _ = random_experts("Q8_0", 3, 64, 96)
    x = torch.randn(2, 64, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 0]], device=DEVICE)
    weights = torch.full((2, 2), 0.5, device=DEVICE)
    cases = [
        (dict(x=x[:, :32]), r"x must be \[tokens, 64\], got \(2, 32\)"),
        (dict(x=x.to(torch.int32)), "x must be bfloat16, float16 or float32, not torch.int32"),
        (dict(topk_ids=ids[:1]), r"topk_ids must be \[2, k >= 1\] for x of 2 tokens, got \(1, 2\)"),
        (dict(topk_ids=ids.float()), "topk_ids must be int32 or int64, not torch.float32"),
        (dict(topk_weights=weights[:, :1]), r"topk_weights must be floating point of topk_ids' shape \(2, 2\)"),
        (dict(method="dense"), "unknown method 'dense': per_token or grouped"),
    ]
    for change, message in cases:
        arguments = dict(x=x, experts=experts, topk_ids=ids, topk_weights=weights) | change
        method = arguments.pop("method", None)
        with pytest.raises(ValueError, match=message):
            fused_moe(**arguments, method=method)
    with pytest.raises(ValueError, match="x, topk_ids, topk_weights and the gate experts must be on one device"):
        fused_moe(x, experts, ids.to("meta"), weights)
    columns_apart = ExpertMatrix(torch.randn(3, 64, 96, device=DEVICE).transpose(1, 2), 64)
    dense, _ = random_experts("fp32", 3, 64, 96)
    with pytest.raises(ValueError, match="the gate experts' rows"):
        fused_moe(x, Experts(columns_apart, dense.up, dense.down), ids, weights)
    with pytest.raises(ValueError, match="dense up experts must be bfloat16, float16 or float32, not torch.int8"):
        fused_moe(x, Experts(dense.gate, ExpertMatrix(torch.zeros(3, 96, 64, dtype=torch.int8, device=DEVICE), 64),
                             dense.down), ids, weights)


@pytest.mark.parametrize("method", METHODS)
def test_expert_ids_outside_the_experts(method):
    """On the CPU a clear error; on CUDA, where checking would sync with the host, such a pair contributes
    nothing (and reads no weights)."""
    experts, reference_experts = random_experts("Q4_0", 3, 64, 96, seed=6)
    x = activations("Q4_0", 9, seed=6)
    ids, weights = uneven_routes(9, 3, 2, seed=6, popular=None, unused=None)
    for bad in (3, -1):
        bad_ids = ids.clone()
        bad_ids[4, 1] = bad
        if DEVICE == "cpu":
            with pytest.raises(ValueError, match=r"topk_ids must be in 0\.\.2"):
                fused_moe(x, experts, bad_ids, weights, method=method)
            continue
        out = fused_moe(x.to(DEVICE), experts, bad_ids.to(DEVICE), weights.to(DEVICE), method=method)
        dropped = weights.clone()
        dropped[4, 1] = 0.0
        assert_equals_reference(out, x, reference_experts, ids, dropped)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_captures_in_a_cuda_graph(method):
    """Nothing syncs with the host (the decode step runs as a CUDA graph): a replay with new routes and
    activations gives what an eager call gives."""
    experts, _ = random_experts("Q4_K", NUM_EXPERTS, 256, 256, seed=8)
    ids, weights = uneven_routes(9, NUM_EXPERTS, TOP_K, seed=8)
    x, ids, weights = activations("Q4_K", 9, seed=8).cuda(), ids.cuda(), weights.cuda()
    fused_moe(x, experts, ids, weights, method=method)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, experts, ids, weights, method=method)
    new_ids, new_weights = uneven_routes(9, NUM_EXPERTS, TOP_K, seed=9, popular=1, unused=0)
    x.copy_(activations("Q4_K", 9, seed=9))
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x, experts, ids, weights, method=method), rtol=0, atol=0)
