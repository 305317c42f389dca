"""Qwen3.5's ImageEncoder (models/vision/qwen3_5_encoder.py) made ready for pictures of drawn sizes and modes:
its inputs are transformers' Qwen2VLImageProcessorPil's pixel_values and image_grid_thw exactly, its text and
span are Qwen3VLProcessor's expansion (one image pad per merged token), and its mRoPE offsets are what
Qwen3_5Model.get_rope_index gives the image's tokens, less the image's start; fixed examples at the bounds (the
smallest picture, the longest side ratio allowed and one past it, refused by name)."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from localserve.models.vision.qwen3_5_encoder import QwenImageEncoder
from localserve.models.vision.qwen3_5_vision import QwenVision, qwen_vision_config
from localserve.models.vision.qwen_preprocess import qwen_image_processing

from tests.helpers.pictures import picture
from tests.helpers.qwen_vision_models import IDS, MERGE, VISION, reference_processor


@pytest.fixture(scope="module")
def encoder() -> QwenImageEncoder:
    """prepare reads no weight: a tower made on the meta device with the reference processor's settings."""
    import json

    config = qwen_vision_config({"vision_config": VISION, **IDS}, "test")
    processing = qwen_image_processing(json.loads(reference_processor().to_json_string()), config, "test")
    with torch.device("meta"):
        vision = QwenVision(config, processing)
    return QwenImageEncoder(vision)


def rope_offsets(grid: list[int]) -> torch.Tensor:
    """get_rope_index's positions of the image tokens of [vision start, pads, vision end], less the first's."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=MERGE)))
    fake.get_vision_position_ids = lambda *args, **kwargs: Qwen3_5Model.get_vision_position_ids(fake, *args, **kwargs)
    tokens = grid[0] * grid[1] * grid[2] // MERGE ** 2
    ids = torch.tensor([[IDS["vision_start_token_id"], *[IDS["image_token_id"]] * tokens, IDS["vision_end_token_id"]]])
    positions, _ = Qwen3_5Model.get_rope_index(fake, ids, (ids == IDS["image_token_id"]).int(),
                                               image_grid_thw=torch.tensor([grid]))
    return positions[:, 0, 1:-1] - 1


def assert_prepared_as_transformers(encoder: QwenImageEncoder, image) -> None:
    expected = reference_processor()(images=[image], return_tensors="pt")
    prepared = encoder.prepare(image)
    pixel_values, grid_thw = prepared.inputs
    assert torch.equal(pixel_values, expected["pixel_values"]) and torch.equal(grid_thw, expected["image_grid_thw"])
    grid = grid_thw[0].tolist()
    tokens = grid[0] * grid[1] * grid[2] // MERGE ** 2
    assert prepared.text == "<|image_pad|>" * tokens
    assert prepared.span_ids == (IDS["image_token_id"],) * tokens and not prepared.bidirectional
    assert torch.equal(prepared.rope_positions, rope_offsets(grid))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(1, 120), height=st.integers(1, 120), mode=st.sampled_from(["RGB", "RGBA", "L", "P"]),
       seed=st.integers(0, 3))
def test_prepare_equals_the_processors_for_drawn_pictures(encoder, width, height, mode, seed):
    if max(width, height) / min(width, height) > 200:
        return
    assert_prepared_as_transformers(encoder, picture(width, height, seed, mode))


def test_bounds(encoder):
    assert_prepared_as_transformers(encoder, picture(1, 1, 0))  # grown to the smallest grid
    assert_prepared_as_transformers(encoder, picture(400, 2, 1))  # the longest side ratio allowed
    with pytest.raises(ValueError, match=r"a 402 x 2 picture is more than 200 times longer than wide"):
        encoder.prepare(picture(402, 2, 1))
    assert encoder.marker == "<|image_pad|>" and encoder.hidden_size == VISION["out_hidden_size"]
