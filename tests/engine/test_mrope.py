"""Qwen3.5's multimodal rotary positions (engine/mrope.py, models/layers/rotary.py) against transformers: a
request's position map, whatever the step's chunking and its company, gives every prompt token the position
Qwen3_5Model.get_rope_index gives it and every generated token its index plus the rope delta (generated
layouts and fixed bounds); the interleaved rotary tables equal Qwen3_5TextRotaryEmbedding's; bad offsets and a
model without mRoPE are refused by name; the loader serves a folder without vision weights as text."""

from __future__ import annotations

import json
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from localserve.models.config import RopeConfig
from localserve.models.layers.rotary import RotaryEmbedding
from localserve.models.vision.qwen3_5_vision import image_rope_positions
from safetensors.torch import save_file

from localserve.engine.mrope import step_rope_positions
from localserve.engine.multimodal import ImageSpan, MultiModalInputs
from localserve.loading.qwen_vision import image_token_text, load_qwen3_5_encoder

MERGE = 2
START, PAD, END = 302, 300, 303


@dataclass
class Chunk:
    """What the runner reads of a step's chunk (engine/step.py's SeqChunk)."""

    token_ids: list[int]
    start_pos: int
    multimodal: MultiModalInputs | None


def request(parts: list) -> tuple[list[int], MultiModalInputs | None, list[tuple[int, int, int]]]:
    """Text runs (a count of tokens) and image grids (1, h, w) -> ids as the processor writes them, the
    MultiModalInputs with the encoder's offsets, the grids."""
    ids: list[int] = []
    spans, offsets, grids = [], [], []
    for part in parts:
        if isinstance(part, tuple):
            rows, _ = image_rope_positions(part, 0, MERGE)
            ids.append(START)
            spans.append(ImageSpan(len(ids), rows.shape[1], bytes([len(spans) + 1])))
            ids += [PAD] * rows.shape[1] + [END]
            offsets.append(rows)
            grids.append(part)
        else:
            ids += [5 + i % 7 for i in range(part)]
    if not spans:
        return ids, None, grids
    return ids, MultiModalInputs(tuple(spans), lambda index: None, rope_positions=tuple(offsets)), grids


def transformers_positions(ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[np.ndarray, int]:
    """Qwen3_5Model.get_rope_index's positions [3, len(ids)] and rope delta."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=MERGE)))
    fake.get_vision_position_ids = lambda *args, **kwargs: Qwen3_5Model.get_vision_position_ids(fake, *args, **kwargs)
    input_ids = torch.tensor([ids])
    positions, delta = Qwen3_5Model.get_rope_index(
        fake, input_ids, (input_ids == PAD).int(), image_grid_thw=torch.tensor(grids) if grids else None)
    return positions[:, 0].numpy(), int(delta)


def expected_positions(ids: list[int], grids, total: int) -> np.ndarray:
    """[3, total]: transformers' positions of the prompt, then each generated token's index plus the delta."""
    prompt, delta = transformers_positions(ids, grids)
    generated = np.arange(len(ids), total) + delta
    return np.concatenate((prompt, np.broadcast_to(generated, (3, len(generated)))), axis=1)


def as_three(positions: np.ndarray) -> np.ndarray:
    return positions if positions.ndim == 2 else np.broadcast_to(positions, (3, positions.shape[0]))


grid_sides = st.integers(1, 6).map(lambda n: n * MERGE)
parts = st.lists(st.one_of(st.integers(0, 5), st.tuples(st.just(1), grid_sides, grid_sides)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=parts, generated=st.integers(0, 6), data=st.data())
def test_positions_in_any_chunking_equal_transformers(parts, generated, data):
    """A request cut into chunks at drawn points, each chunk in a step beside a text-only request's chunk
    (drawn before or after it): each step's positions for it are transformers' (module doc), the other's plain."""
    ids, multimodal, grids = request(parts)
    if not ids:
        return
    total = len(ids) + generated
    tokens = ids + [9] * generated
    cuts = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=5)) if total > 1 else [])
    expected = expected_positions(ids, grids, total) if grids else np.broadcast_to(np.arange(total), (3, total))
    for low, high in zip([0, *cuts], [*cuts, total]):
        ours = Chunk(tokens[low:high], low, multimodal)
        other = Chunk([4] * data.draw(st.integers(1, 3)), data.draw(st.integers(0, 50)), None)
        first = data.draw(st.booleans())
        step = [ours, other] if first else [other, ours]
        positions = step_rope_positions(step)
        if multimodal is None:
            assert positions is None
            continue
        three = as_three(positions)
        mine = three[:, :high - low] if first else three[:, len(other.token_ids):]
        theirs = three[:, high - low:] if first else three[:, :len(other.token_ids)]
        assert np.array_equal(mine, expected[:, low:high])
        assert np.array_equal(theirs, np.broadcast_to(np.arange(other.start_pos, other.start_pos + len(
            other.token_ids)), theirs.shape))
        touches_image = any(span.offset < high and low < span.end for span in multimodal.spans)
        assert positions.ndim == (2 if touches_image else 1)


def test_fixed_layouts_at_the_bounds():
    """An image alone (its first token at 0 after vision start), one of 1 x 1 merged token, two back to back,
    a square one (delta 0 for a 2 x 2 grid of 4 tokens: max side 2, 4 tokens: -2) and decodes far past them."""
    for layout in ([(1, 2, 2)], [(1, 2, 2), (1, 4, 12)], [3, (1, 12, 2), (1, 2, 2), 0, (1, 4, 4)], [0, (1, 8, 8), 7]):
        ids, multimodal, grids = request(layout)
        expected = expected_positions(ids, grids, len(ids) + 40)
        got = as_three(step_rope_positions([Chunk(ids + [9] * 40, 0, multimodal)]))
        assert np.array_equal(got, expected), layout
        decode = step_rope_positions([Chunk([9], len(ids) + 39, multimodal)])
        assert decode.shape == (1,) and decode[0] == expected[0, -1]
    assert step_rope_positions([Chunk([1, 2], 0, None)]) is None


def reference_rotary(sections: list[int], rotary_dim: int, positions: torch.Tensor):
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    config = transformers.Qwen3_5TextConfig(head_dim=rotary_dim * 4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": sections})
    rotary = Qwen3_5TextRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize("sections, rotary_dim", [([2, 1, 1], 8), ([11, 11, 10], 64), ([1, 3, 1], 8), ([3, 3, 3], 8)])
def test_rotary_tables_equal_transformers_interleaved_mrope(sections, rotary_dim):
    """[3, T] positions (the sections may cover more or fewer frequencies than there are: clipped as theirs)."""
    positions = torch.randint(0, 5000, (3, 37), generator=torch.Generator().manual_seed(0))
    ours = RotaryEmbedding(RopeConfig(mrope_section=tuple(sections)), rotary_dim)
    cos, sin = ours(positions, torch.float32)
    want_cos, want_sin = reference_rotary(sections, rotary_dim, positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    text = positions[0]  # a text token's three positions are equal: plain rotary
    assert all(torch.equal(a, b) for a, b in zip(ours(text.expand(3, -1), torch.float32), ours(text, torch.float32)))


def test_3d_positions_without_sections_are_refused():
    with pytest.raises(ValueError, match=r"need \[3, tokens\] and a model with multimodal rotary sections"):
        RotaryEmbedding(RopeConfig(), 8)(torch.zeros(3, 4, dtype=torch.int64), torch.float32)


@pytest.mark.parametrize("offsets, message", [
    ((torch.zeros(3, 5, dtype=torch.int64),), r"image span 0 \(tokens \[2, 6\)\): rope_positions of shape \(3, 5\)"),
    ((torch.zeros(3, 4),), r"image span 0 \(tokens \[2, 6\)\): its rope_positions must be an integer tensor"),
    ((torch.full((3, 4), -1),), r"rope_positions must be offsets >= 0"),
    ((), r"1 image spans but 0 rope_positions tensors"),
    ([torch.zeros(3, 4, dtype=torch.int64)], r"rope_positions must be a tuple"),
])
def test_bad_offsets_are_refused_naming_the_span(offsets, message):
    with pytest.raises(ValueError, match=message):
        MultiModalInputs((ImageSpan(2, 4, b"x"),), lambda index: None, rope_positions=offsets)


def test_an_engine_without_mrope_refuses_rope_positions(tiny64):
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from localserve.engine.sampling_params import SamplingParams

    engine = build_engine(tiny64, None, EngineConfig(num_kv_blocks=16))
    multimodal = MultiModalInputs((ImageSpan(1, 4, b"x"),), [torch.zeros(4, 64, dtype=torch.float64)],
                                  rope_positions=(image_rope_positions((1, 4, 4), 0, 2)[0],))
    with pytest.raises(ValueError, match=r"carry 3D rotary positions .* has no multimodal rotary \(mrope_section\)"):
        engine.add_request([3, 7, 7, 7, 7, 4], SamplingParams(max_tokens=2), multimodal=multimodal)


def test_the_loader_serves_a_folder_without_vision_weights_as_text(tmp_path):
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "vision_config": {"depth": 1}}
    save_file({"model.language_model.embed_tokens.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    assert load_qwen3_5_encoder(tmp_path, config, torch.float32, "cpu") is None
    assert load_qwen3_5_encoder(tmp_path, {"architectures": config["architectures"]}, torch.float32, "cpu") is None
    assert image_token_text(tmp_path, 300) == "<|image_pad|>"  # no tokenizer files: the released text
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "300": {"content": "<|img|>", "special": True}}}))
    assert image_token_text(tmp_path, 300) == "<|img|>"
