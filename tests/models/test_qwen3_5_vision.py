"""Qwen3.5/3.6's vision encoder (models/vision/qwen3_5_vision.py) against transformers on the same random weights:
a tiny Qwen3_5ForConditionalGeneration's `get_image_features` for pictures of different sizes (both
checkpoint spellings), the Pillow preprocessing against Qwen2VLImageProcessorPil's pixel_values and
image_grid_thw exactly (fixed and generated), the image tokens' mRoPE positions against get_rope_index, and
what is refused, by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from localserve.models.vision.config import VisionConfigError
from localserve.models.vision.qwen3_5_vision import (
    QWEN_TOKEN_DEFAULTS,
    QWEN_VISION_DEFAULTS,
    image_rope_positions,
    qwen_vision_config,
)
from localserve.models.vision.qwen_preprocess import (
    CLIP_MEAN,
    CLIP_STD,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    qwen_image_processing,
    qwen_preprocess,
    smart_resize,
)
from PIL import Image
from safetensors.torch import load_file, save_file

from localserve.loading.qwen_vision import load_qwen3_5_vision
from tests.helpers.models import save_random_model
from tests.helpers.pictures import picture, reencoded
from tests.helpers.qwen_vision_models import (
    IDS,
    MAX_PIXELS,
    MEAN,
    MERGE,
    PATCH,
    TEMPORAL,
    custom_processor,
    tiny_qwen3_5,
)
from tests.helpers.vision_models import assert_bad_weights_refused

RELATIVE = 1e-5  # fp32: the largest difference from transformers, relative to its largest value


def ours_for(processor, vision_fields: dict | None = None):
    config = qwen_vision_config({"vision_config": {"patch_size": PATCH, "spatial_merge_size": MERGE,
                                                   "temporal_patch_size": TEMPORAL} | (vision_fields or {})}, "test")
    return qwen_image_processing(json.loads(processor.to_json_string()), config, "test")


def assert_same_patches(images: list[Image.Image], **options) -> torch.Tensor:
    processor = custom_processor(**options)
    expected = processor(images=images, return_tensors="pt")
    pixel_values, grid_thw = qwen_preprocess(images, ours_for(processor))
    assert torch.equal(grid_thw, expected["image_grid_thw"]) and grid_thw.dtype == torch.int64
    assert pixel_values.dtype == torch.float32 and pixel_values.shape == expected["pixel_values"].shape
    assert torch.equal(pixel_values, expected["pixel_values"]), (pixel_values - expected["pixel_values"]).abs().max()
    return grid_thw


@pytest.fixture(scope="module")
def qwen_vision(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("qwen3_5_vision")
    hf_model = save_random_model(folder, tiny_qwen3_5(), model_class=transformers.Qwen3_5ForConditionalGeneration)
    custom_processor().save_pretrained(folder)
    return folder, hf_model


def two_pictures() -> list[Image.Image]:
    """Two sizes (so two grids): 53 x 37 -> 14 x 10 patches (35 tokens), 70 x 20 -> 18 x 4 (18 tokens)."""
    return [reencoded(picture(53, 37, seed=1), "PNG"), reencoded(picture(70, 20, seed=2), "JPEG")]


def reference_features(hf_model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return hf_model.model.get_image_features(pixel_values, grid_thw).pooler_output


def assert_features_close(ours: list[torch.Tensor], expected: tuple[torch.Tensor, ...]) -> None:
    assert [tuple(x.shape) for x in ours] == [tuple(x.shape) for x in expected]
    for mine, theirs in zip(ours, expected):
        assert (mine - theirs).abs().max() <= RELATIVE * theirs.abs().max(), (mine - theirs).abs().max()


def test_encode_matches_transformers_image_features(qwen_vision):
    folder, hf_model = qwen_vision
    vision = load_qwen3_5_vision(folder)
    config = vision.config
    assert (config.depth, config.out_hidden_size, config.position_side) == (2, 64, 4)
    assert (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id) == (300, 302, 303)
    assert (vision.processing.pixels.mean, vision.processing.max_pixels) == (tuple(MEAN), MAX_PIXELS)
    pictures = two_pictures()
    grid_thw = assert_same_patches(pictures)
    assert grid_thw.tolist() == [[1, 10, 14], [1, 4, 18]]
    tokens = [config.tokens_per_image(tuple(grid)) for grid in grid_thw.tolist()]
    assert tokens == [35, 18]
    assert config.placeholder_ids((1, 4, 18)) == [302, *[300] * 18, 303]
    pixel_values, _ = qwen_preprocess(pictures, vision.processing)
    ours = vision.encode(pixel_values, grid_thw)
    assert_features_close(ours, reference_features(hf_model, pixel_values, grid_thw))
    alone = vision.encode(pixel_values[140:], grid_thw[1:])  # batch == alone (image 0 has 140 patches)
    assert_features_close(alone, (ours[1],))



def test_two_frame_grid_attends_per_frame(qwen_vision):
    """A grid of 2 frames (as a video's): each frame attends to itself, both take the same positions."""
    folder, hf_model = qwen_vision
    vision = load_qwen3_5_vision(folder)
    grid_thw = torch.tensor([[2, 4, 6], [1, 2, 2]])
    pixel_values = torch.randn(52, 96, generator=torch.Generator().manual_seed(9))
    ours = vision.encode(pixel_values, grid_thw)
    assert [tuple(x.shape) for x in ours] == [(12, 64), (1, 64)]
    assert_features_close(ours, reference_features(hf_model, pixel_values, grid_thw))

def test_bfloat16_encode_follows_transformers(qwen_vision):
    import transformers

    folder, _ = qwen_vision
    hf_model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    vision = load_qwen3_5_vision(folder, dtype=torch.bfloat16)
    assert {param.dtype for param in vision.parameters()} == {torch.bfloat16}
    pixel_values, grid_thw = qwen_preprocess(two_pictures(), vision.processing)
    ours = vision.encode(pixel_values, grid_thw)
    expected = reference_features(hf_model, pixel_values.bfloat16(), grid_thw)
    for mine, theirs in zip(ours, expected):
        assert mine.dtype == torch.bfloat16
        assert (mine.float() - theirs.float()).abs().max() <= 0.03 * theirs.float().abs().max()


def test_unprefixed_layout_one_block_and_default_processing(tmp_path):
    """`visual.*` names (no `model.`), depth 1, a wider position table, no processor file (the class defaults
    with the tower's patch sizes), a picture at the smallest size."""
    import transformers

    hf_model = save_random_model(tmp_path, tiny_qwen3_5(depth=1, num_position_embeddings=36), seed=3,
                                 model_class=transformers.Qwen3_5ForConditionalGeneration)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {name.removeprefix("model.") if name.startswith("model.visual.") else name: tensor
               for name, tensor in tensors.items()}
    assert any(name.startswith("visual.") for name in renamed)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    vision = load_qwen3_5_vision(tmp_path)
    processing = vision.processing
    assert (processing.pixels.mean, processing.pixels.std, processing.pixels.resample) == (CLIP_MEAN, CLIP_STD, 3)
    assert (processing.min_pixels, processing.max_pixels, processing.patch_size) == (
        DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS, PATCH)
    pixel_values, grid_thw = qwen_preprocess([picture(2, 2, seed=4)], processing)
    assert grid_thw.tolist() == [[1, 14, 14]]  # grown to 56 x 56, the fewest pixels
    assert_features_close(vision.encode(pixel_values, grid_thw), reference_features(hf_model, pixel_values, grid_thw))


def test_image_rope_positions_match_get_rope_index(qwen_vision):
    """A prompt of text, image (grid 10 x 14), text, image (4 x 18), text: our positions per image and the text
    around them as transformers' get_rope_index gives them."""
    _, hf_model = qwen_vision
    grids = [(1, 10, 14), (1, 4, 18)]
    config = load_qwen3_5_vision(qwen_vision[0]).config
    pieces = [[5, 6, 7], config.placeholder_ids(grids[0]), [8, 9], config.placeholder_ids(grids[1]), [10]]
    ids = torch.tensor([[token for piece in pieces for token in piece]])
    expected, delta = hf_model.model.get_rope_index(ids, (ids == IDS["image_token_id"]).int(),
                                                    image_grid_thw=torch.tensor(grids))
    ours, position = [], 0
    for token in ids[0].tolist():
        if token == IDS["image_token_id"]:
            if not ours or ours[-1][0] != "image":
                grid = grids[sum(1 for kind, _ in ours if kind == "image")]
                image, after = image_rope_positions(grid, position, MERGE)
                ours.append(("image", image))
                position = after
        else:
            ours.append(("text", torch.full((3, 1), position)))
            position += 1
    ours_positions = torch.cat([positions for _, positions in ours], dim=1)
    assert torch.equal(ours_positions, expected[:, 0])
    assert int(delta) == int(ours_positions.max()) + 1 - ids.shape[1]  # decode: position = index + delta
    image, after = image_rope_positions((1, 4, 18), 11, MERGE)
    assert image[:, :3].tolist() == [[11, 11, 11], [11, 11, 11], [11, 12, 13]] and after == 11 + 9


MODES = ["RGB", "RGBA", "L", "LA", "P", "P_transparent", "CMYK", "1"]
FILES = [(mode, "PNG") for mode in MODES if mode != "CMYK"] + [(mode, "JPEG") for mode in ("RGB", "L", "CMYK")]


@pytest.mark.parametrize("mode,fmt", FILES)
def test_preprocess_matches_the_processor(mode, fmt):
    assert_same_patches([reencoded(picture(37, 23, seed=5, mode=mode), fmt),
                         reencoded(picture(61, 90, seed=6, mode=mode), fmt)])


@pytest.mark.parametrize("width,height", [(1, 1), (16, 16), (1, 200), (200, 1), (48, 48), (49, 48), (200, 199),
                                          (8, 9)])
def test_preprocess_at_the_size_bounds(width, height):
    """The smallest picture, the aspect ratio bound (200), exactly min and max pixels and one past."""
    assert_same_patches([picture(width, height, seed=7)])


@pytest.mark.parametrize("width,height", [(1, 201), (402, 2)])
def test_preprocess_refuses_an_aspect_ratio_past_200(width, height):
    with pytest.raises(ValueError, match="absolute aspect ratio"):
        custom_processor()(images=[picture(width, height, seed=0)])
    with pytest.raises(ValueError, match=f"image 0: .*a {width} x {height} picture is more than 200 times"):
        qwen_preprocess([picture(width, height, seed=0)], ours_for(custom_processor()))


@pytest.mark.parametrize("options", [dict(resample=2), dict(resample=0), dict(do_rescale=False),
                                     dict(do_normalize=False), dict(size={"shortest_edge": 8 * 8,
                                                                          "longest_edge": 8 * 8 * 3})])
def test_preprocess_follows_the_processor_options(options):
    assert_same_patches([reencoded(picture(45, 33, seed=8, mode="RGBA"), "PNG")], **options)


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(width=st.integers(1, 120), height=st.integers(1, 120), mode=st.sampled_from(MODES), jpeg=st.booleans(),
       seed=st.integers(0, 3), resample=st.sampled_from([2, 3]))
def test_preprocess_generated(width, height, mode, jpeg, seed, resample):
    fmt = "JPEG" if (jpeg and (mode, "JPEG") in FILES) or mode == "CMYK" else "PNG"
    assert_same_patches([reencoded(picture(width, height, seed, mode), fmt)], resample=resample)


@settings(max_examples=300, deadline=None, database=None)
@given(height=st.integers(1, 5000), width=st.integers(1, 5000), factor=st.sampled_from([8, 28, 32]),
       min_pixels=st.integers(1, 200_000), extra=st.integers(0, 4_000_000))
def test_smart_resize_generated(height, width, factor, min_pixels, extra):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    if max(height, width) / min(height, width) > 200:
        return
    expected = reference(height, width, factor, min_pixels, min_pixels + extra)
    assert smart_resize(height, width, factor, min_pixels, min_pixels + extra) == expected


def test_our_defaults_are_transformers():
    import transformers

    vision = transformers.Qwen3_5VisionConfig()
    assert {name: getattr(vision, name) for name in QWEN_VISION_DEFAULTS} == QWEN_VISION_DEFAULTS
    assert vision.rope_parameters["rope_theta"] == qwen_vision_config({"vision_config": {}}, "c").rope_theta
    config = transformers.Qwen3_5Config()
    assert {name: getattr(config, name) for name in QWEN_TOKEN_DEFAULTS} == QWEN_TOKEN_DEFAULTS
    assert qwen_vision_config({"vision_config": {"model_type": "qwen3_5_moe_vision"}}, "c").depth == vision.depth
    processor = transformers.Qwen2VLImageProcessorPil()
    assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    assert (tuple(processor.image_mean), tuple(processor.image_std), processor.resample) == (CLIP_MEAN, CLIP_STD, 3)


def test_a_released_config_reads(tmp_path):
    """Qwen3.6-27B's config.json (its vision_config still says model_type qwen3_5, and leaves rope and the
    activation out): 27 blocks of 1152, patches of 16, merged 2 x 2 into 5120; a 1024 x 768 picture becomes
    64 x 48 patches, 768 tokens."""
    from pathlib import Path

    source = Path(__file__).parent.parent / "helpers" / "qwen3_6_27b_config.json"
    config = qwen_vision_config(json.loads(source.read_text()), str(source))
    assert (config.depth, config.hidden_size, config.patch_size, config.out_hidden_size) == (27, 1152, 16, 5120)
    assert (config.image_token_id, config.vision_start_token_id, config.rope_theta) == (248_056, 248_053, 10_000.0)
    height, width = smart_resize(768, 1024, 32, 65_536, 16_777_216)
    assert (height, width) == (768, 1024) and config.tokens_per_image((1, height // 16, width // 16)) == 768
    assert math.isqrt(config.num_position_embeddings) == 48


GOOD_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 4,
               "out_hidden_size": 64, "num_position_embeddings": 16, "model_type": "qwen3_5_vision"}


@pytest.mark.parametrize("change,message", [
    ({"vision_config": None}, "no vision_config"),
    ({"vision_config": [1]}, "vision_config must be an object"),
    ({"vision_config": GOOD_VISION | {"model_type": "siglip_vision_model"}}, "vision_config.model_type"),
    ({"vision_config": GOOD_VISION | {"patch_size": None}}, "vision_config.patch_size must be a positive integer"),
    ({"vision_config": GOOD_VISION | {"patch_size": [4, 8]}}, "vision_config.patch_size must be a positive"),
    ({"vision_config": GOOD_VISION | {"depth": "2"}}, "vision_config.depth must be a positive integer"),
    ({"vision_config": GOOD_VISION | {"num_heads": 3}}, "hidden_size 32 / num_heads 3 must be a whole head size"),
    ({"vision_config": GOOD_VISION | {"num_heads": 16}}, "hidden_size 32 / num_heads 16 must be a whole head"),
    ({"vision_config": GOOD_VISION | {"num_position_embeddings": 15}}, "num_position_embeddings 15 must be a"),
    ({"vision_config": GOOD_VISION | {"hidden_act": "relu"}}, "vision_config.hidden_act 'relu'"),
    ({"vision_config": GOOD_VISION | {"rope_parameters": {"rope_type": "yarn"}}}, "rope_type 'yarn'"),
    ({"vision_config": GOOD_VISION | {"rope_parameters": {"rope_theta": 0}}}, "rope_theta must be a positive"),
    ({"image_token_id": -1}, "image_token_id must be a positive integer"),
    ({"text_config": {"hidden_size": 48}}, "out_hidden_size 64 must equal text_config.hidden_size 48"),
])
def test_config_errors_name_the_field(change, message):
    config = {"vision_config": GOOD_VISION, "text_config": {"hidden_size": 64}} | change
    with pytest.raises(VisionConfigError, match="config.json") as error:
        qwen_vision_config(config, "config.json")
    assert message in str(error.value)


@pytest.mark.parametrize("change,message", [
    ({"patch_size": 8}, "patch_size 8 differs from the vision tower's 4"),
    ({"merge_size": 1}, "merge_size 1 differs from the vision tower's 2"),
    ({"temporal_patch_size": 0}, "temporal_patch_size must be a positive integer"),
    ({"size": [1, 2]}, "size must be an object"),
    ({"size": {"shortest_edge": 0, "longest_edge": 10}}, "shortest_edge must be a positive integer"),
    ({"min_pixels": 5000, "max_pixels": 4000}, "min pixels 5000 (size.shortest_edge) exceed max pixels 4000"),
    ({"do_resize": False}, "do_resize false is not supported"),
    ({"resample": 9}, "resample 9 is not a Pillow filter"),
    ({"image_mean": [0.5, 0.5]}, "image_mean must be a number or 3 numbers"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std [0.5, 0.0, 0.5] has a zero"),
    ({"rescale_factor": -1}, "rescale_factor must be a positive number"),
])
def test_processor_config_errors_name_the_field(change, message):
    vision = qwen_vision_config({"vision_config": GOOD_VISION}, "config.json")
    with pytest.raises(VisionConfigError, match="preprocessor_config.json") as error:
        qwen_image_processing({"size": {"shortest_edge": 256, "longest_edge": 2304}} | change, vision,
                              "preprocessor_config.json")
    assert message in str(error.value)


def test_bad_weights_and_inputs_are_named(qwen_vision, tmp_path):
    folder, _ = qwen_vision
    assert_bad_weights_refused(folder, tmp_path, load_qwen3_5_vision, [
        (lambda tensors: {name: tensor for name, tensor in tensors.items() if "merger.norm" not in name},
         "missing vision tensors: merger.norm.bias, merger.norm.weight"),
        (lambda tensors: tensors | {"model.visual.pos_embed.weight": torch.zeros(25, 32)},
         r"model.visual.pos_embed.weight has shape \[25, 32\]"),
        (lambda tensors: tensors | {"model.visual.blocks.5.norm1.weight": torch.zeros(32)},
         "unexpected vision tensor model.visual.blocks.5.norm1.weight")])
    vision = load_qwen3_5_vision(folder)
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match=r"pixel_values must be \[patches, 96\]; got \[16, 48\]"):
        vision.encode(torch.zeros(16, 48), grid)
    with pytest.raises(ValueError, match="must be floating point"):
        vision.encode(torch.zeros(16, 96, dtype=torch.uint8), grid)
    with pytest.raises(ValueError, match="grid_thw gives 16 patches; pixel_values has 12"):
        vision.encode(torch.zeros(12, 96), grid)
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \[1, 3, 4\] must be positive"):
        vision.encode(torch.zeros(12, 96), torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match=r"grid_thw must be \[images, 3\]"):
        vision.encode(torch.zeros(16, 96), torch.tensor([1, 4, 4]))
    with pytest.raises(TypeError, match="image 1 is a bytes"):
        qwen_preprocess([picture(5, 5, 0), b"png"], vision.processing)
    with pytest.raises(ValueError, match="no images"):
        qwen_preprocess([], vision.processing)


@pytest.mark.gpu
def test_cuda_bfloat16_encode_follows_transformers(qwen_vision):
    import transformers

    folder, _ = qwen_vision
    hf_model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    vision = load_qwen3_5_vision(folder, dtype=torch.bfloat16, device="cuda")
    pixel_values, grid_thw = qwen_preprocess(two_pictures(), vision.processing)
    ours = vision.encode(pixel_values, grid_thw)  # moved to the weights' device by encode
    expected = reference_features(hf_model, pixel_values.cuda().bfloat16(), grid_thw.cuda())
    for mine, theirs in zip(ours, expected):
        assert mine.device.type == "cuda" and mine.dtype == torch.bfloat16
        assert (mine.float() - theirs.float()).abs().max() <= 0.03 * theirs.float().abs().max()
