"""Qwen3.5's mmproj (loading/mmproj_qwen.py) against the checkpoint folder it was converted from: a tiny
Qwen3_5ForConditionalGeneration converted by llama.cpp's own convert_hf_to_gguf.py `--mmproj` (f32, f16) gives
QwenVision the folder's config, the folder processor's patches (the folder's pixel bounds set to llama.cpp's,
8 to 4096 image tokens, which the file does not keep) and the folder encoder's embeddings for pictures of
several sizes; what is refused, by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from localserve.models.vision.qwen_preprocess import qwen_preprocess

from localserve.loading.mmproj import MmprojError, read_mmproj
from localserve.loading.mmproj_qwen import QWEN_IMAGE_TOKENS, load_mmproj_qwen_vision
from localserve.loading.qwen_vision import load_qwen3_5_vision
from tests.helpers.gguf_convert import rewrite_gguf
from tests.helpers.mmproj_files import convert_mmproj
from tests.helpers.models import save_random_model
from tests.helpers.pictures import picture, reencoded
from tests.helpers.qwen_vision_models import IDS, MERGE, PATCH, custom_processor, tiny_qwen3_5

TOKEN_IDS = {"image": IDS["image_token_id"], "video": IDS["video_token_id"], "start": IDS["vision_start_token_id"],
             "end": IDS["vision_end_token_id"]}
TOKEN_PIXELS = (PATCH * MERGE) ** 2


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("qwen3_5_mmproj")
    save_random_model(folder, tiny_qwen3_5(), model_class=transformers.Qwen3_5ForConditionalGeneration)
    custom_processor(size={"shortest_edge": 8 * TOKEN_PIXELS, "longest_edge": 4096 * TOKEN_PIXELS}
                     ).save_pretrained(folder)
    return folder, {outtype: convert_mmproj(folder, folder.parent / f"mmproj-qwen-{outtype}.gguf", outtype)
                    for outtype in ("f32", "f16")}


def pictures() -> list:
    return [reencoded(picture(37, 23, seed=1), "PNG"), reencoded(picture(90, 61, seed=2, mode="RGBA"), "PNG"),
            picture(5, 9, seed=3)]


@pytest.mark.parametrize("outtype,atol", [("f32", 2e-5), ("f16", 0.02)])
def test_mmproj_gives_the_folder_encoders_embeddings(qwen_pair, outtype, atol):
    folder, files = qwen_pair
    reference = load_qwen3_5_vision(folder)
    mmproj = read_mmproj(files[outtype])
    assert mmproj.projector == "qwen3vl_merger"
    vision = load_mmproj_qwen_vision(mmproj, TOKEN_IDS)
    assert vision.config == reference.config
    expected_processing = reference.processing
    assert dataclasses.replace(vision.processing, pixels=expected_processing.pixels) == expected_processing
    for image in pictures():
        pixel_values, grid = qwen_preprocess([image], reference.processing)
        ours_values, ours_grid = qwen_preprocess([image], vision.processing)
        assert torch.equal(ours_grid, grid) and torch.equal(ours_values, pixel_values)
        [ours], [wanted] = vision.encode(pixel_values, grid), reference.encode(pixel_values, grid)
        torch.testing.assert_close(ours, wanted, rtol=0, atol=atol)
        if outtype == "f16":
            assert (ours - wanted).abs().max() > 0


def test_qwen_refusals_are_named(qwen_pair, tmp_path):
    _, files = qwen_pair
    deep = rewrite_gguf(files["f32"], tmp_path / "deep.gguf", metadata={"clip.vision.is_deepstack_layers": [True,
                                                                                                          False]})
    with pytest.raises(MmprojError, match="deep.gguf: clip.vision.is_deepstack_layers: deepstack layers"):
        load_mmproj_qwen_vision(read_mmproj(deep), TOKEN_IDS)
    half = rewrite_gguf(files["f32"], tmp_path / "half.gguf",
                        change=lambda name, values: [] if name == "v.patch_embd.weight.1" else None)
    with pytest.raises(MmprojError, match="half.gguf: missing tensor v.patch_embd.weight.1"):
        load_mmproj_qwen_vision(read_mmproj(half), TOKEN_IDS)
    wide = rewrite_gguf(files["f32"], tmp_path / "wide.gguf", metadata={"clip.vision.projection_dim": 128})
    with pytest.raises(MmprojError, match=r"wide.gguf: mm.2.bias has shape \[64\]; the metadata gives \[128\]"):
        load_mmproj_qwen_vision(read_mmproj(wide), TOKEN_IDS)
    assert set(QWEN_IMAGE_TOKENS) == set(TOKEN_IDS)


@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.generate])
@given(depth=st.integers(1, 2), heads=st.sampled_from([1, 2]), patch=st.sampled_from([2, 4]),
       merge=st.sampled_from([1, 2]), positions_side=st.integers(2, 5), seed=st.integers(0, 3))
def test_generated_shapes_through_the_converter(tmp_path_factory, depth, heads, patch, merge, positions_side, seed):
    """Tower shapes drawn, converted by llama.cpp's converter (f32), give the folder encoder's embeddings."""
    import transformers

    folder = tmp_path_factory.mktemp("generated_qwen")
    config = tiny_qwen3_5(depth=depth, num_heads=heads, patch_size=patch, spatial_merge_size=merge,
                          num_position_embeddings=positions_side ** 2)
    save_random_model(folder, config, seed=seed, model_class=transformers.Qwen3_5ForConditionalGeneration)
    token_pixels = (patch * merge) ** 2
    custom_processor(patch_size=patch, merge_size=merge, size={"shortest_edge": 8 * token_pixels,
                                                               "longest_edge": 4096 * token_pixels}
                     ).save_pretrained(folder)
    reference = load_qwen3_5_vision(folder)
    vision = load_mmproj_qwen_vision(read_mmproj(convert_mmproj(folder, folder / "mmproj.gguf")), TOKEN_IDS)
    assert vision.config == reference.config
    image = picture(29 + seed * 7, 41, seed=seed)
    pixel_values, grid = qwen_preprocess([image], vision.processing)
    expected_values, expected_grid = qwen_preprocess([image], reference.processing)
    assert torch.equal(grid, expected_grid) and torch.equal(pixel_values, expected_values)
    [ours], [wanted] = vision.encode(pixel_values, grid), reference.encode(pixel_values, grid)
    torch.testing.assert_close(ours, wanted, rtol=0, atol=2e-5)
