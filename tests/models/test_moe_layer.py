"""The mixture-of-experts MLP against its definition computed token by token in float64: the router's k
experts, each a gated MLP, weighed and summed, plus the shared expert (gated or not). The experts' product
sums in float32 (kernels/moe_experts.py), hence the tolerance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.models.config import MoEConfig
from localserve.models.layers.moe import MoE
from localserve.models.layers.routers import route

HIDDEN = 16


def make_moe(moe: MoEConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(HIDDEN, moe).double()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.5)
    return layer


def expert_output(layer: MoE, expert: int, x: torch.Tensor) -> torch.Tensor:
    experts = layer.experts

    def project(name: str, value: torch.Tensor) -> torch.Tensor:
        out = getattr(experts, f"{name}_proj")[expert] @ value
        bias = getattr(experts, f"{name}_bias", None)
        return out if bias is None else out + bias[expert]

    return project("down", torch.nn.functional.silu(project("gate", x)) * project("up", x))


def direct(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    rows = []
    for token in x:
        weights, ids = route(layer.gate(token[None]), layer.config, getattr(layer, "selection_bias", None))
        out = sum(w * expert_output(layer, e, token) for w, e in zip(weights[0].double(), ids[0].tolist()))
        if hasattr(layer, "shared_expert"):
            shared = layer.shared_expert(token)
            if hasattr(layer, "shared_expert_gate"):
                shared = torch.sigmoid(layer.shared_expert_gate(token)) * shared
            out = out + shared
        rows.append(out)
    return torch.stack(rows)


@st.composite
def layers(draw):
    num_experts = draw(st.integers(1, 6))
    shared = draw(st.sampled_from([0, 8]))
    moe = MoEConfig(num_experts=num_experts, top_k=draw(st.integers(1, num_experts)), intermediate_size=8,
                    router=draw(st.sampled_from(["softmax_topk", "topk_softmax", "sigmoid_grouped"])),
                    normalize=draw(st.booleans()), router_bias=draw(st.booleans()), expert_bias=draw(st.booleans()),
                    selection_bias=draw(st.booleans()), shared_intermediate_size=shared,
                    shared_expert_gate=bool(shared) and draw(st.booleans()))
    return moe, draw(st.integers(1, 9)), draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(layers())
def test_moe_layer_is_its_definition(case):
    moe, num_tokens, seed = case
    layer = make_moe(moe, seed)
    x = torch.randn(num_tokens, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.allclose(layer(x), direct(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
def test_every_token_to_one_expert_and_an_expert_no_token_chooses(gated):
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=8, shared_intermediate_size=8,
                    shared_expert_gate=gated)
    layer = make_moe(moe)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[3, 0] = 50.0  # expert 3 first for every token (x[:, 0] > 0)...
        layer.gate.weight[1, 0] = -50.0  # ...and expert 1 never
        layer.experts.gate_proj[1] = float("nan")  # whatever an unchosen expert holds never reaches the output
    x = torch.randn(7, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[:, 0] = x[:, 0].abs() + 0.5
    with torch.no_grad():
        out = layer(x)
        assert out.isfinite().all()
        weights, ids = route(layer.gate(x), moe)
        assert (ids[:, 0] == 3).all() and not (ids == 1).any()
        layer.experts.gate_proj[1] = 0.0
        assert torch.allclose(out, direct(layer, x), rtol=1e-5, atol=1e-6)
