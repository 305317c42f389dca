"""Target.regroup and Target.values (loading/pieces.py): head groups put back in the model's order, stored
values mapped back, against an index-by-index reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.models.family import Target

from localserve.loading.pieces import regroup, take


def reference(tensor: torch.Tensor, axis: int, start: int, outer: int, inner: int, size: int) -> torch.Tensor:
    """Entry start + (i * outer + o) * size + s of the result is entry start + (o * inner + i) * size + s."""
    index = list(range(tensor.shape[axis]))
    for o in range(outer):
        for i in range(inner):
            for s in range(size):
                index[start + (i * outer + o) * size + s] = start + (o * inner + i) * size + s
    return tensor.index_select(axis, torch.tensor(index))


@settings(max_examples=60, deadline=None)
@given(outer=st.integers(1, 4), inner=st.integers(1, 4), size=st.integers(1, 5), before=st.integers(0, 6),
       after=st.integers(0, 6), other=st.integers(1, 3), axis=st.integers(0, 1), seed=st.integers(0, 1000))
def test_regroup_moves_each_entry_where_the_reference_says(outer, inner, size, before, after, other, axis, seed):
    length = before + outer * inner * size + after
    shape = (length, other) if axis == 0 else (other, length)
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    moved = regroup(tensor, axis, before, outer, inner, size)
    assert torch.equal(moved, reference(tensor, axis, before, outer, inner, size))
    assert torch.equal(regroup(moved, axis, before, inner, outer, size), tensor)  # its own inverse, swapped


@pytest.mark.parametrize(("start", "outer", "inner", "size", "length"), [
    (0, 1, 3, 2, 6),  # one group: nothing moves
    (0, 3, 1, 2, 6),
    (0, 2, 3, 1, 6),  # whole tensor, single entries
    (4, 2, 2, 1, 8),  # the region touching the end
    (0, 2, 2, 2, 8),  # the region from the start, filling it
])
def test_regroup_at_the_bounds(start, outer, inner, size, length):
    tensor = torch.arange(length * 2.0).reshape(length, 2)
    assert torch.equal(regroup(tensor, 0, start, outer, inner, size), reference(tensor, 0, start, outer, inner, size))


def test_regroup_past_the_end_is_refused():
    with pytest.raises(ValueError, match="runs past 8 entries along axis 0"):
        regroup(torch.zeros(8, 2), 0, 1, 2, 2, 2)


def test_value_map_and_regroup_through_take():
    a_log = torch.tensor([-1.5, 0.25, 2.0, -3.0])
    stored = -a_log.exp()[[0, 2, 1, 3]]  # as llama.cpp writes it, value heads tiled (2 key heads, 2 each)
    target = Target("A_log", regroup=(0, 2, 2, 1), values="log_neg")
    torch.testing.assert_close(take(stored, target), a_log, rtol=1e-6, atol=1e-6)


def test_unknown_value_map_is_named():
    with pytest.raises(ValueError, match="unknown value map 'exp'"):
        Target("x", values="exp")
