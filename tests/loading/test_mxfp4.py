"""Hugging Face MXFP4 pairs (`_blocks`/`_scales`): dequantized here as transformers dequantizes them, and
repacked into GGUF MXFP4 blocks that gguf-py dequantizes to the same values; pairs that are no MXFP4
refused naming the tensor."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from localserve.loading import mxfp4


def transformers_dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, rows, groups * 32] as transformers reads the pair (its function returns [E, columns, rows])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)


@st.composite
def pairs(draw):
    experts, rows, groups = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    blocks = draw(arrays(np.uint8, (experts, rows, groups, 16)))
    # exponents 2^-27 .. 2^27 (transformers' bf16/fp32 lookup overflows nowhere there), and 0 and 254 apart
    scales = draw(arrays(np.uint8, (experts, rows, groups), elements=st.integers(100, 154)))
    return torch.from_numpy(blocks), torch.from_numpy(scales)


@settings(max_examples=40, deadline=None)
@given(pair=pairs())
def test_dequantized_as_transformers_and_repacked_as_gguf(pair):
    blocks, scales = pair
    expected = transformers_dequantized(blocks, scales)
    assert torch.equal(mxfp4.dequantize("w", blocks, scales), expected)
    packed = mxfp4.to_gguf_blocks("w", blocks, scales)
    assert packed.qtype == "MXFP4" and packed.shape == tuple(expected.shape)
    assert packed.blocks.shape == (*expected.shape[:2], expected.shape[2] // 32 * 17)
    from_gguf = gguf.quants.dequantize(packed.blocks.numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(torch.from_numpy(from_gguf.copy()), expected)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_exponents_at_their_limits():
    """E8M0 0 (2^-127) and 254 (2^127) on every code: the same values gguf-py reads from the repacked blocks
    (6 * 2^127 is past float32's largest: infinite in both)."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16)
    scales = torch.tensor([[[0, 254] * 8]], dtype=torch.uint8)
    ours = mxfp4.dequantize("w", blocks, scales)
    packed = mxfp4.to_gguf_blocks("w", blocks, scales).blocks.numpy()
    assert torch.equal(torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4).copy()), ours)
    # group 1's byte 3 is 0x13: value 6 its low nibble (code 3: 1.5), value 7 its high one (code 1: 0.5)
    assert ours[0, 0, 32 + 6].item() == 1.5 * 2.0 ** 127 and ours[0, 0, 32 + 7].item() == 0.5 * 2.0 ** 127
    assert ours[0, 0, 32 + 14].item() == float("inf")  # byte 7 = 0x17: code 7 (6.0)


@pytest.mark.parametrize("blocks,scales,message", [
    (torch.zeros(2, 3, 16, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.uint8), "must be uint8"),
    (torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), "(2, 3, 8)"),
    (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), "scales of shape (2, 4)"),
])
def test_pairs_that_are_no_mxfp4_are_refused_naming_the_tensor(blocks, scales, message):
    for read in (mxfp4.dequantize, mxfp4.to_gguf_blocks):
        with pytest.raises(mxfp4.MXFP4Error) as info:
            read("model.layers.0.mlp.experts.down_proj_blocks", blocks, scales)
        assert "down_proj_blocks" in str(info.value) and message in str(info.value)
