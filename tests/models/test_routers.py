"""The routers against a direct implementation of their definitions (models/layers/routers.py's docstring),
one token at a time in float64, on generated logits and at their edges."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.models.config import ModelConfigError, MoEConfig
from localserve.models.layers.routers import route


def by_preference(values: list[float]) -> list[int]:
    """Indices from the largest value down, the lower index first among equal values."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def direct(logits: list[float], moe: MoEConfig, bias: list[float] | None) -> tuple[list[int], list[float]]:
    """One token's expert ids and weights, straight from the definition."""
    k = moe.top_k
    if moe.router == "softmax_topk":
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        probs = [e / sum(exps) for e in exps]
        ids = by_preference(probs)[:k]
        weights = [probs[i] for i in ids]
        if moe.normalize:
            weights = [w / sum(weights) for w in weights]
        return ids, weights
    if moe.router == "topk_softmax":
        ids = by_preference(logits)[:k]
        top = max(logits[i] for i in ids)
        exps = [math.exp(logits[i] - top) for i in ids]
        return ids, [e / sum(exps) for e in exps]
    scores = [1 / (1 + math.exp(-x)) for x in logits]
    choice = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
    size = len(logits) // moe.num_groups
    group_scores = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(moe.num_groups)]
    groups = set(by_preference(group_scores)[:moe.topk_groups])
    candidates = [c if i // size in groups else -math.inf for i, c in enumerate(choice)]
    ids = by_preference(candidates)[:k]
    weights = [scores[i] for i in ids]
    if moe.normalize:
        weights = [w / (sum(weights) + 1e-20) for w in weights]
    return ids, [w * moe.routed_scaling_factor for w in weights]


def check(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None = None) -> torch.Tensor:
    weights, ids = route(logits, moe, bias)
    assert weights.dtype == torch.float32 and ids.shape == weights.shape == (logits.shape[0], moe.top_k)
    for row in range(logits.shape[0]):
        want_ids, want_weights = direct(logits[row].double().tolist(), moe, None if bias is None else bias.tolist())
        assert ids[row].tolist() == want_ids, (row, logits[row])
        assert weights[row].tolist() == pytest.approx(want_weights, rel=1e-5, abs=1e-6)
    return ids


@st.composite
def router_cases(draw):
    kind = draw(st.sampled_from(["softmax_topk", "topk_softmax", "sigmoid_grouped"]))
    num_groups = draw(st.sampled_from([1, 2, 4])) if kind == "sigmoid_grouped" else 1
    num_experts = num_groups * draw(st.integers(1, 4)) * (1 if num_groups > 1 else draw(st.integers(1, 3)))
    topk_groups = draw(st.integers(1, num_groups))
    reachable = topk_groups * (num_experts // num_groups)
    moe = MoEConfig(num_experts=num_experts, top_k=draw(st.integers(1, reachable)), intermediate_size=8,
                    router=kind, normalize=draw(st.booleans()), num_groups=num_groups, topk_groups=topk_groups,
                    routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))
    num_tokens = draw(st.integers(1, 6))
    # Logits on a coarse grid: exact ties happen, and values that differ differ by far more than rounding.
    grid = st.integers(-12, 12).map(lambda x: x / 4)
    logits = torch.tensor(draw(st.lists(st.lists(grid, min_size=num_experts, max_size=num_experts),
                                        min_size=num_tokens, max_size=num_tokens)))
    bias = None
    if kind == "sigmoid_grouped" and draw(st.booleans()):
        bias = torch.tensor(draw(st.lists(st.integers(-4, 4).map(lambda x: x / 8), min_size=num_experts,
                                          max_size=num_experts)))
    return logits, moe, bias


@settings(max_examples=150, deadline=None)
@given(router_cases())
def test_routers_follow_their_definitions(case):
    check(*case)


KINDS = ["softmax_topk", "topk_softmax", "sigmoid_grouped"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalize", [False, True])
def test_ties_go_to_the_lower_expert(kind, normalize):
    moe = MoEConfig(num_experts=6, top_k=3, intermediate_size=8, router=kind, normalize=normalize)
    ids = check(torch.zeros(3, 6), moe)
    assert ids.tolist() == [[0, 1, 2]] * 3
    ids = check(torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 1.0]]), moe)
    assert ids.tolist() == [[1, 2, 4]]


@pytest.mark.parametrize("kind", KINDS)
def test_k_equal_to_the_number_of_experts_takes_all_by_preference(kind):
    moe = MoEConfig(num_experts=5, top_k=5, intermediate_size=8, router=kind, normalize=True)
    ids = check(torch.tensor([[0.5, -1.0, 2.0, 0.5, 1.0]]), moe)
    assert ids.tolist() == [[2, 4, 0, 3, 1]]


@pytest.mark.parametrize("kind", KINDS)
def test_one_expert_chosen_by_every_token_and_one_by_none(kind):
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=8, router=kind)
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    logits[:, 3] += 20.0
    logits[:, 1] -= 20.0
    ids = check(logits, moe)
    assert (ids[:, 0] == 3).all() and not (ids == 1).any()


def test_selection_bias_chooses_but_does_not_weigh():
    moe = MoEConfig(num_experts=4, top_k=1, intermediate_size=8, router="sigmoid_grouped")
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    weights, ids = route(logits, moe, torch.tensor([0.0, 0.0, 2.0, 0.0]))
    assert ids.tolist() == [[2]] and weights.item() == pytest.approx(0.5)  # sigmoid(0), not 0.5 + 2


def test_groups_limit_the_choice():
    # Groups {0,1} and {2,3}: the second group's best two sum higher, so expert 0, the single best, is out.
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=8, router="sigmoid_grouped", num_groups=2,
                    topk_groups=1)
    ids = check(torch.tensor([[3.0, -3.0, 2.0, 2.0]]), moe)
    assert ids.tolist() == [[2, 3]]


@pytest.mark.parametrize(("fields", "words"), [
    ({"router": "sparsemixer"}, "router kind 'sparsemixer'"),
    ({"top_k": 5}, "num_experts_per_tok 5"),
    ({"top_k": 0}, "num_experts_per_tok 0"),
    ({"router": "sigmoid_grouped", "num_groups": 3}, "4 experts in 3 groups"),
])
def test_a_router_it_cannot_run_is_refused_naming_the_field(fields, words):
    with pytest.raises(ModelConfigError, match=words):
        MoEConfig(**{"num_experts": 4, "top_k": 2, "intermediate_size": 8} | fields)
