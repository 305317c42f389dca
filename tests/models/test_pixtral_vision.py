"""Mistral 3's vision encoder (models/vision/pixtral.py, mistral3_vision.py, pixtral_preprocess.py,
mistral3_encoder.py) against transformers on the same random weights: the Pillow preprocessing against
PixtralImageProcessorPil's pixel values and sizes exactly (fixed pictures at the bound and one past it, every
mode, generated ones), a tiny Mistral3ForConditionalGeneration's `get_image_features` for pictures of
different sizes at once and alone, the `ImageEncoder`'s text, span and rows, and what is refused, by name."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from localserve.models.vision.config import VisionConfigError
from localserve.models.vision.mistral3_encoder import image_text, load_mistral3_encoder
from localserve.models.vision.pixtral import mistral3_vision_config
from localserve.models.vision.pixtral_preprocess import (
    CLIP_MEAN,
    pixtral_image_processing,
    pixtral_preprocess,
    pixtral_resize,
)
from PIL import Image
from safetensors.torch import load_file, save_file

from localserve.loading.image_encoders import load_image_encoder
from localserve.loading.pixtral_vision import load_mistral3_vision
from localserve.loading.vision import VisionLoadError
from tests.helpers.pictures import picture, reencoded
from tests.helpers.pixtral_models import (
    IMG,
    IMG_BREAK,
    IMG_END,
    LONGEST_EDGE,
    MEAN,
    MERGE,
    PATCH,
    reference_image_processor,
    write_tiny_mistral3,
)

RELATIVE = 1e-5  # fp32: the largest difference from transformers, relative to its largest value
MODES = ["RGB", "RGBA", "L", "LA", "P", "P_transparent", "CMYK", "1"]


def ours_for(processor) -> object:
    return pixtral_image_processing(json.loads(processor.to_json_string()), PATCH, MERGE, 64, "test")


def assert_same_pixels(pictures: list[Image.Image], **options) -> list[torch.Tensor]:
    """Our pixel values of each picture equal the reference's (its padded batch cropped to each one's size)."""
    processor = reference_image_processor(**options)
    expected = processor(images=pictures, return_tensors="pt")
    ours = [pixtral_preprocess(image, ours_for(processor)) for image in pictures]
    assert [list(values.shape[1:]) for values in ours] == expected["image_sizes"].tolist()
    for values, (height, width), padded in zip(ours, expected["image_sizes"].tolist(), expected["pixel_values"]):
        assert values.dtype == torch.float32
        assert torch.equal(values, padded[:, :height, :width]), (values - padded[:, :height, :width]).abs().max()
    return ours


@pytest.mark.parametrize("size, tokens", [
    ((53, 37), (5, 6)),  # width, height -> token rows, cols: 48 x 33 after scaling, sides rounded up to 8
    ((45, 29), (4, 6)),  # within the bound: sides rounded up
    ((48, 48), (6, 6)),  # at the bound: kept
    ((49, 48), (6, 6)),  # one past: scaled by 49/48, floored to 47 x 47, rounded up to 48
    ((48, 49), (6, 6)),
    ((96, 10), (1, 6)),  # halved to 48 x 5
    ((8, 8), (1, 1)),  # one token
    ((1, 1), (1, 1)),  # grown to one token
    ((300, 7), (1, 6)),  # 48 x 1 after scaling
])
def test_preprocess_equals_pixtral_image_processor_at_the_bound(size, tokens):
    [values] = assert_same_pixels([reencoded(picture(*size, seed=3), "PNG")])
    assert (values.shape[1] // (PATCH * MERGE), values.shape[2] // (PATCH * MERGE)) == tokens


@pytest.mark.parametrize("mode", MODES)
def test_preprocess_equals_pixtral_image_processor_in_every_mode(mode):
    assert_same_pixels([picture(30, 21, seed=5, mode=mode), reencoded(picture(17, 40, seed=6), "JPEG")])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 130), height=st.integers(1, 130), seed=st.integers(0, 5),
       mode=st.sampled_from(["RGB", "RGBA", "L", "P_transparent"]), edge=st.sampled_from([16, 24, 48, 56]))
def test_generated_pictures_preprocess_as_transformers(width, height, seed, mode, edge):
    pixels = picture(width, height, seed, mode)
    try:
        pixtral_resize(height, width, edge, edge, PATCH * MERGE)
    except ValueError:  # a side floors to no pixel: refused by name (below); transformers fails there too
        with pytest.raises(ValueError):
            reference_image_processor(size={"longest_edge": edge})(images=[pixels], return_tensors="pt")
        return
    assert_same_pixels([pixels], size={"longest_edge": edge})


def test_a_picture_flooring_to_no_pixel_is_refused_by_name():
    with pytest.raises(ValueError, match=r"48 x 0 pixels \(too long for its width\)"):
        pixtral_resize(1, 100, 48, 48, 8)
    with pytest.raises(ValueError, match="no pixels"):
        pixtral_resize(0, 5, 48, 48, 8)
    assert pixtral_resize(40, 100, 48, 48, 8) == (24, 48)  # 19.2 -> 19 -> 24


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral3_vision")
    return folder, write_tiny_mistral3(folder)


def two_pictures() -> list[Image.Image]:
    """Two sizes: 53 x 37 -> 48 x 33 -> 48 x 40 pixels (5 x 6 tokens); 70 x 20 -> 48 x 13 -> 16 x 48 pixels (2 x 6)."""
    return [reencoded(picture(53, 37, seed=1), "PNG"), reencoded(picture(70, 20, seed=2), "JPEG")]


def reference_features(hf_model, pictures: list[Image.Image]) -> tuple[torch.Tensor, ...]:
    batch = reference_image_processor()(images=pictures, return_tensors="pt")
    with torch.no_grad():
        return hf_model.model.get_image_features(batch["pixel_values"], batch["image_sizes"]).pooler_output


def assert_close(mine: torch.Tensor, theirs: torch.Tensor, relative: float = RELATIVE) -> None:
    assert mine.shape == theirs.shape
    assert (mine.float() - theirs.float()).abs().max() <= relative * theirs.float().abs().max(), \
        (mine - theirs).abs().max()


def test_encode_matches_transformers_image_features(mistral3):
    folder, hf_model = mistral3
    vision = load_mistral3_vision(folder)
    config = vision.config
    assert (config.vision.num_layers, config.vision.hidden_act, config.text_hidden_size) == (2, "silu", 64)
    assert (config.spatial_merge_size, config.image_token_id, config.norm_eps) == (MERGE, IMG, 1e-5)
    assert (vision.processing.max_height, vision.processing.pixels.mean) == (LONGEST_EDGE, tuple(MEAN))
    pictures = two_pictures()
    pixel_values = [pixtral_preprocess(image, vision.processing) for image in pictures]
    ours = vision.encode(pixel_values)
    expected = reference_features(hf_model, pictures)
    assert [tuple(x.shape) for x in ours] == [(30, 64), (12, 64)]
    for mine, theirs in zip(ours, expected):
        assert_close(mine, theirs)
    [alone] = vision.encode(pixel_values[1:])  # batch == alone: each picture attends to itself only
    assert_close(alone, expected[1])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=3),
       seed=st.integers(0, 100))
def test_generated_batches_encode_as_transformers(mistral3, sizes, seed):
    """1-3 pictures of 1-6 x 1-6 image tokens each, random pixels, at once: each one's features are
    transformers' (from its padded batch)."""
    assume(sum(rows * cols for rows, cols in sizes) > 1)  # transformers squeezes a lone token's features away
    folder, hf_model = mistral3
    vision = load_mistral3_vision(folder)
    generator = torch.Generator().manual_seed(seed)
    side = PATCH * MERGE
    pixels = [torch.randn(3, rows * side, cols * side, generator=generator) for rows, cols in sizes]
    padded = torch.zeros(len(pixels), 3, max(r for r, _ in sizes) * side, max(c for _, c in sizes) * side)
    for index, values in enumerate(pixels):
        padded[index, :, :values.shape[1], :values.shape[2]] = values
    image_sizes = torch.tensor([list(values.shape[1:]) for values in pixels])
    with torch.no_grad():
        expected = hf_model.model.get_image_features(padded, image_sizes).pooler_output
    for mine, theirs, (rows, cols) in zip(vision.encode(pixels), expected, sizes):
        assert mine.shape == (rows * cols, 64)
        assert_close(mine, theirs)


def test_bfloat16_encode_follows_transformers(mistral3):
    import transformers

    folder, _ = mistral3
    hf_model = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    vision = load_mistral3_vision(folder, dtype=torch.bfloat16)
    assert {param.dtype for param in vision.parameters()} == {torch.bfloat16}
    pictures = two_pictures()
    batch = reference_image_processor()(images=pictures, return_tensors="pt")
    with torch.no_grad():
        expected = hf_model.model.get_image_features(batch["pixel_values"].bfloat16(), batch["image_sizes"])
    ours = vision.encode([pixtral_preprocess(image, vision.processing) for image in pictures])
    for mine, theirs in zip(ours, expected.pooler_output):
        assert mine.dtype == torch.bfloat16
        assert_close(mine, theirs, 0.03)


def test_the_encoder_writes_pixtral_rows_and_gives_features_and_break_embeddings(mistral3):
    """Through load_image_encoder (the registered loader): the text PixtralProcessor writes (rows of [IMG]
    joined by [IMG_BREAK], [IMG_END] last), tokenized to the span plus [IMG_END]; the span's rows are the
    features at [IMG] and the break token's embedding at [IMG_BREAK]."""
    from localserve.tokenizer.tokenizer import Tokenizer

    folder, hf_model = mistral3
    config = json.loads((folder / "config.json").read_text())
    encoder = load_image_encoder(folder, config, torch.float32, "cpu")
    assert encoder.marker == "[IMG]" and encoder.hidden_size == 64
    image = two_pictures()[1]  # 2 x 6 tokens
    prepared = encoder.prepare(image)
    assert prepared.text == "[IMG]" * 6 + "[IMG_BREAK]" + "[IMG]" * 6 + "[IMG_END]"
    assert prepared.span_ids == (IMG,) * 6 + (IMG_BREAK,) + (IMG,) * 6
    assert not prepared.bidirectional and prepared.rope_positions is None
    tokenizer = Tokenizer.from_hf_folder(folder)
    assert tokenizer.encode(prepared.text, add_special_tokens=False) == [*prepared.span_ids, IMG_END]
    rows = encoder.encode(prepared)
    assert rows.shape == (13, 64)
    [features] = reference_features(hf_model, [image])
    assert_close(rows[:6], features[:6])
    assert_close(rows[7:], features[6:])
    assert torch.equal(rows[6], hf_model.model.language_model.embed_tokens.weight[IMG_BREAK])
    one_row = encoder.prepare(picture(30, 5, seed=1))  # 1 x 4 tokens: no break
    assert one_row.span_ids == (IMG,) * 4 and one_row.text.endswith("[IMG][IMG_END]")
    assert encoder.encode(one_row).shape == (4, 64)
    assert image_text(encoder.tokens, 3, 1) == "[IMG][IMG_BREAK][IMG][IMG_BREAK][IMG][IMG_END]"


def test_model_prefixed_layout_without_processor_config(tmp_path):
    """Tensors under `model.` (transformers 5's module names: `model.vision_tower.*`,
    `model.language_model.*`; its save_pretrained writes the earlier `vision_tower.*` and
    `language_model.model.*`), one layer, no processor file: PixtralImageProcessor's defaults bounded by the
    tower's image_size (64 pixels)."""
    hf_model = write_tiny_mistral3(tmp_path, seed=3, processor=False, vision={"num_hidden_layers": 1})
    tensors = load_file(tmp_path / "model.safetensors")
    assert "vision_tower.ln_pre.weight" in tensors and "language_model.model.embed_tokens.weight" in tensors
    renamed = {}
    for name, tensor in tensors.items():
        name = "model." + name if name.startswith(("vision_tower.", "multi_modal_projector.")) else name
        renamed[name.replace("language_model.model.", "model.language_model.")] = tensor
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    encoder = load_mistral3_encoder(tmp_path, json.loads((tmp_path / "config.json").read_text()), torch.float32,
                                    "cpu")
    processing = encoder.vision.processing
    assert (processing.max_height, processing.pixels.mean, processing.pixels.resample) == (64, CLIP_MEAN, 3)
    image = picture(100, 50, seed=4)  # -> 64 x 32 pixels: 4 x 8 tokens
    prepared = encoder.prepare(image)
    assert prepared.inputs.shape == (3, 32, 64)
    reference = reference_image_processor(size={"longest_edge": 64}, image_mean=CLIP_MEAN,
                                          image_std=[0.26862954, 0.26130258, 0.27577711])
    batch = reference(images=[image], return_tensors="pt")
    assert torch.equal(prepared.inputs, batch["pixel_values"][0])
    with torch.no_grad():
        [features] = hf_model.model.get_image_features(batch["pixel_values"], batch["image_sizes"]).pooler_output
    rows = encoder.encode(prepared)
    assert rows.shape == (4 * 9 - 1, 64)
    assert_close(rows[[i for i in range(35) if i % 9 != 8]], features)
    for i in (8, 17, 26):
        assert torch.equal(rows[i], hf_model.model.language_model.embed_tokens.weight[IMG_BREAK])


def test_an_earlier_feature_layer_is_taken(tmp_path):
    hf_model = write_tiny_mistral3(tmp_path, seed=5, vision_feature_layer=-2)
    vision = load_mistral3_vision(tmp_path)
    assert vision.vision_tower.feature_layer == 1
    pictures = two_pictures()
    ours = vision.encode([pixtral_preprocess(image, vision.processing) for image in pictures])
    for mine, theirs in zip(ours, reference_features(hf_model, pictures)):
        assert_close(mine, theirs)


BASE = {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {"hidden_size": 64},
        "vision_config": {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2, "patch_size": 4}}


@pytest.mark.parametrize("change, message", [
    ({"vision_config": None}, "no vision_config"),
    ({"vision_config": {"model_type": "siglip_vision_model"}}, "model_type 'siglip_vision_model' is not served"),
    ({"vision_config": {"hidden_size": 30, "num_attention_heads": 2}}, "divisible by 4"),
    ({"vision_config": {"hidden_act": "tanh"}}, "hidden_act 'tanh' is not supported"),
    ({"vision_config": {"head_dim": 8}}, "head_dim 8 differs"),
    ({"vision_config": {"rope_parameters": {"rope_type": "yarn"}}}, "rope_type 'yarn' is not supported"),
    ({"vision_feature_layer": [-1, -2]}, "a list of layers is not served"),
    ({"vision_feature_layer": 3}, r"vision_feature_layer 3 must be one layer's index in \[-3, 2\]"),
    ({"spatial_merge_size": 0}, "spatial_merge_size must be a positive integer"),
    ({"projector_hidden_act": "swiglu"}, "projector_hidden_act 'swiglu' is not supported"),
    ({"multimodal_projector_bias": "no"}, "multimodal_projector_bias must be true or false"),
    ({"text_config": {"hidden_size": 64, "rms_norm_eps": 2}}, "rms_norm_eps must be a number in"),
])
def test_bad_configs_are_refused_by_name(change, message):
    config = json.loads(json.dumps(BASE))
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] |= value
        else:
            config[key] = value
    with pytest.raises(VisionConfigError, match=message):
        mistral3_vision_config(config, "x/config.json")


@pytest.mark.parametrize("config, processor, message", [
    ({"patch_size": {"height": 5, "width": 5}}, {}, "patch_size .* is neither the tower's 4 nor"),
    ({}, {"spatial_merge_size": 1}, "the processor's spatial_merge_size 1 differs from the model's 2"),
    ({"do_resize": False}, {}, "do_resize false is not supported"),
    ({"do_center_crop": True, "crop_size": {"height": 8, "width": 8}}, {}, "do_center_crop is not supported"),
    ({"size": {"shortest_edge": 10}}, {}, "size must hold longest_edge, or height and width"),
    ({"size": {"longest_edge": 0}}, {}, "size.longest_edge must be a positive integer"),
    ({"image_std": [0.1, 0.0, 0.2]}, {}, "has a zero"),
])
def test_bad_processor_configs_are_refused_by_name(config, processor, message):
    with pytest.raises(VisionConfigError, match=message):
        pixtral_image_processing(config, PATCH, MERGE, 64, "p.json", processor)


def test_bad_checkpoints_are_refused_naming_the_file(tmp_path):
    write_tiny_mistral3(tmp_path, seed=1)
    config = json.loads((tmp_path / "config.json").read_text())
    assert load_mistral3_encoder(tmp_path, config | {"vision_config": None}, torch.float32, "cpu") is None
    with pytest.raises(VisionLoadError, match="image_token_index 11 is not the tokenizer's '\\[IMG\\]' \\(10\\)"):
        load_mistral3_encoder(tmp_path, config | {"image_token_index": 11}, torch.float32, "cpu")
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_token": "[PICTURE]"}))
    with pytest.raises(VisionLoadError, match=r"the tokenizer has no image_token '\[PICTURE\]'"):
        load_mistral3_encoder(tmp_path, config, torch.float32, "cpu")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("multi_modal_projector.linear_2.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VisionLoadError, match="missing vision tensors: multi_modal_projector.linear_2.weight"):
        load_mistral3_encoder(tmp_path, config, torch.float32, "cpu")
    text_only = {name: tensor for name, tensor in tensors.items() if name.startswith("language_model.")}
    save_file(text_only, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert load_mistral3_encoder(tmp_path, config, torch.float32, "cpu") is None  # saved without its eyes: text
