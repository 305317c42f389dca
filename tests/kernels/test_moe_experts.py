"""moe_reference (the CPU path and the fused kernels' reference) against the definition written out token by
token, and the experts' shape checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.kernels.gguf_blocks import QUANT_FORMATS
from localserve.kernels.moe_experts import ExpertMatrix, Experts, moe_reference

from tests.helpers.moe import random_experts, uneven_routes


def by_definition(x: torch.Tensor, experts: Experts, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j w[t, j] * down_e(silu(gate_e x_t + b) * (up_e x_t + b)) + b, in float64, one token at a time."""
    def project(matrix: ExpertMatrix, expert: int, vector: torch.Tensor) -> torch.Tensor:
        out = matrix.data[expert].double() @ vector
        return out if matrix.bias is None else out + matrix.bias[expert].double()

    rows = []
    for token in range(x.shape[0]):
        total = torch.zeros(experts.hidden_size, dtype=torch.float64)
        for expert, weight in zip(ids[token].tolist(), weights[token].tolist(), strict=True):
            vector = x[token].double()
            gate, up = project(experts.gate, expert, vector), project(experts.up, expert, vector)
            hidden = torch.nn.functional.silu(gate) * up
            total += weight * project(experts.down, expert, hidden)
        rows.append(total)
    return torch.stack(rows)


@settings(max_examples=20, deadline=None)
@given(num_experts=st.integers(1, 6), top_k=st.integers(1, 6), num_tokens=st.integers(1, 10),
       biases=st.booleans(), popular=st.booleans(), seed=st.integers(0, 2**16))
def test_reference_equals_definition(num_experts, top_k, num_tokens, biases, popular, seed):
    top_k = min(top_k, num_experts)
    _, experts = random_experts("fp32", num_experts, 48, 80, seed, biases)
    ids, weights = uneven_routes(num_tokens, num_experts, top_k, seed, 0 if popular else None, None)
    x = torch.randn(num_tokens, 48, generator=torch.Generator().manual_seed(seed))
    out = moe_reference(x, experts, ids, weights)
    torch.testing.assert_close(out.double(), by_definition(x, experts, ids, weights), rtol=1e-5, atol=1e-5)


def test_every_token_on_one_expert_and_k_equal_to_the_experts():
    _, experts = random_experts("fp32", 3, 48, 80, seed=1)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(1))
    for ids in (torch.zeros(4, 1, dtype=torch.int64), torch.tensor([[2, 0, 1]] * 4)):
        weights = torch.softmax(torch.randn(4, ids.shape[1], generator=torch.Generator().manual_seed(2)), -1)
        torch.testing.assert_close(moe_reference(x, experts, ids, weights).double(),
                                   by_definition(x, experts, ids, weights), rtol=1e-5, atol=1e-5)


def test_shapes_that_disagree_are_clear_errors():
    dense = torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match=r"expert weights of shape \(2, 8, 16\) do not hold 32 columns"):
        ExpertMatrix(dense, 32)
    q8 = QUANT_FORMATS["Q8_0"]
    with pytest.raises(ValueError, match="do not hold 64 columns of Q8_0 blocks"):
        ExpertMatrix(torch.zeros(2, 8, 34, dtype=torch.uint8), 64, q8)
    with pytest.raises(ValueError, match="Q8_0 expert blocks must be uint8, not torch.float32"):
        ExpertMatrix(torch.zeros(2, 8, 68), 64, q8)
    with pytest.raises(ValueError, match=r"an expert bias of shape \(2, 7\)"):
        ExpertMatrix(dense, 16, bias=torch.zeros(2, 7))
    gate = ExpertMatrix(torch.zeros(2, 8, 16), 16)
    with pytest.raises(ValueError, match="expert projections disagree"):
        Experts(gate, gate, ExpertMatrix(torch.zeros(2, 16, 4), 4))
    with pytest.raises(ValueError, match="unknown expert activation 'gelu'; known: silu"):
        Experts(gate, gate, ExpertMatrix(torch.zeros(2, 16, 8), 8), activation="gelu")
