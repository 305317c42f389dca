"""Gemma 3's vision encoder (models/vision/) against transformers on the same random weights: the SigLIP
tower and projector of a tiny Gemma3ForConditionalGeneration (both checkpoint layouts) give
`get_image_features`' embeddings; the Pillow preprocessing gives Gemma3ImageProcessor's pixel values
exactly, on PNG and JPEG files of odd sizes and modes (fixed and generated); what is refused, by name."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from localserve.models.vision.config import SIGLIP_DEFAULTS, VisionConfigError, gemma3_vision_config
from localserve.models.vision.preprocess import ImageProcessing, image_processing, preprocess
from PIL import Image
from safetensors.torch import load_file, save_file

from localserve.loading.vision import folder_image_processing, load_gemma_vision
from tests.helpers.models import save_random_model
from tests.helpers.pictures import picture, reencoded
from tests.helpers.vision_models import (
    MEAN,
    STD,
    assert_bad_weights_refused,
    gemma3_image_processor,
    save_processor,
    tiny_gemma3,
)


def assert_same_pixels(images: list[Image.Image], size: int, **options) -> None:
    expected = gemma3_image_processor(size, **options)(images=images, return_tensors="pt")["pixel_values"]
    processing = image_processing(json.loads(gemma3_image_processor(size, **options).to_json_string()), size, "test")
    ours = preprocess(images, processing)
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert torch.equal(ours, expected), (ours - expected).abs().max()


@pytest.fixture(scope="module")
def gemma3_vision(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("gemma3_vision")
    hf_model = save_random_model(folder, tiny_gemma3(), model_class=transformers.Gemma3ForConditionalGeneration)
    save_processor(folder, 56)
    return folder, hf_model


def two_pictures(size: int) -> list[Image.Image]:
    return [reencoded(picture(size + 13, size - 5, seed=1), "PNG"), reencoded(picture(size + 13, size - 5, seed=2),
                                                                              "JPEG")]


def reference_features(hf_model, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model.get_image_features(pixel_values, return_dict=True).pooler_output


def test_encode_matches_transformers_image_features(gemma3_vision):
    folder, hf_model = gemma3_vision
    vision = load_gemma_vision(folder)
    config = vision.config
    assert (config.mm_tokens_per_image, config.pool_kernel, config.text_hidden_size) == (4, 2, 64)
    assert (config.image_token_id, config.boi_token_id, config.eoi_token_id) == (319, 317, 318)
    assert config.placeholder_ids() == [317, 319, 319, 319, 319, 318]
    processing = vision.processing
    assert (processing.mean, processing.std, processing.height) == (tuple(MEAN), tuple(STD), 56)
    pixel_values = preprocess(two_pictures(56), processing)
    expected = reference_features(hf_model, pixel_values)
    ours = vision.encode(pixel_values)
    assert ours.shape == (2, 4, 64)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    assert (ours[0] - ours[1]).abs().max() > 0.1  # the two pictures differ
    torch.testing.assert_close(vision.encode(pixel_values[1:]), ours[1:], rtol=0, atol=1e-5)  # batch == alone


def test_bfloat16_encode_follows_transformers(gemma3_vision):
    import transformers

    folder, _ = gemma3_vision
    hf_model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    vision = load_gemma_vision(folder, dtype=torch.bfloat16)
    assert {param.dtype for param in vision.parameters()} == {torch.bfloat16}
    pixel_values = preprocess(two_pictures(56), vision.processing)
    ours, expected = vision.encode(pixel_values), reference_features(hf_model, pixel_values.bfloat16())
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), expected.float(), rtol=0.02, atol=0.05)


def test_model_prefixed_layout_and_one_token_per_patch(tmp_path):
    """transformers 5's `model.` spelling (with the older `vision_model.` level of the tower), no pooling
    head, and mm_tokens_per_image equal to the patches (pooling kernel 1), one layer."""
    import transformers

    config = tiny_gemma3(image_size=56, mm_tokens=16, layers=1, vision_use_head=False)
    hf_model = save_random_model(tmp_path, config, seed=3, model_class=transformers.Gemma3ForConditionalGeneration)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {("model.vision_tower.vision_model." + name.removeprefix("vision_tower.")
                if name.startswith("vision_tower.") else "model." + name): tensor for name, tensor in tensors.items()}
    assert not any(".head." in name for name in renamed)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    vision = load_gemma_vision(tmp_path)
    assert vision.config.pool_kernel == 1 and vision.processing.mean == (0.5, 0.5, 0.5)  # no processor file
    pixel_values = preprocess(two_pictures(56), vision.processing)
    ours = vision.encode(pixel_values)
    assert ours.shape == (2, 16, 64)
    torch.testing.assert_close(ours, reference_features(hf_model, pixel_values), rtol=0, atol=1e-5)


MODES = ["RGB", "RGBA", "L", "LA", "P", "P_transparent", "CMYK", "1"]


# each mode in the formats that hold it: PNG everything but CMYK, JPEG RGB, grey and CMYK
FILES = [(mode, "PNG") for mode in MODES if mode != "CMYK"] + [(mode, "JPEG") for mode in ("RGB", "L", "CMYK")]


@pytest.mark.parametrize("mode,fmt", FILES)
def test_preprocess_matches_gemma3_image_processor(mode, fmt):
    images = [reencoded(picture(37, 23, seed=5, mode=mode), fmt), reencoded(picture(61, 90, seed=6, mode=mode), fmt)]
    assert_same_pixels(images, 28)


def test_preprocess_matches_on_a_16_bit_grey_png():
    grey = Image.fromarray((torch.arange(37 * 23).reshape(23, 37) * 70).to(torch.int32).numpy().astype("uint16"))
    image = reencoded(grey, "PNG")
    assert image.mode == "I;16"
    assert_same_pixels([image], 28)


def test_processor_config_nested_in_processor_config_json(tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": 4,
         "image_processor": {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 28, "width": 28},
                             "image_mean": MEAN, "image_std": STD, "resample": 3}}))
    processing = folder_image_processing(tmp_path, 28)
    assert (processing.mean, processing.std, processing.resample) == (tuple(MEAN), tuple(STD), 3)
    (tmp_path / "preprocessor_config.json").write_text("{")
    with pytest.raises(VisionConfigError, match="preprocessor_config.json: unreadable"):
        folder_image_processing(tmp_path, 28)


@pytest.mark.parametrize("width,height", [(1, 1), (28, 28), (1, 200), (200, 1), (29, 27)])
def test_preprocess_at_the_size_bounds(width, height):
    assert_same_pixels([picture(width, height, seed=7)], 28)


@pytest.mark.parametrize("options", [dict(resample=3), dict(resample=0), dict(do_rescale=False),
                                     dict(do_normalize=False)])
def test_preprocess_follows_the_processor_options(options):
    assert_same_pixels([reencoded(picture(45, 33, seed=8, mode="RGBA"), "PNG")], 28, **options)


@settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(width=st.integers(1, 120), height=st.integers(1, 120), mode=st.sampled_from(MODES),
       jpeg=st.booleans(), seed=st.integers(0, 3), resample=st.sampled_from([2, 3]))
def test_preprocess_generated(width, height, mode, jpeg, seed, resample):
    image = picture(width, height, seed, mode)
    fmt = "JPEG" if (jpeg and (mode, "JPEG") in FILES) or mode == "CMYK" else "PNG"
    assert_same_pixels([reencoded(image, fmt)], 28, resample=resample)


def test_our_siglip_defaults_are_transformers():
    import transformers

    defaults = transformers.SiglipVisionConfig()
    assert {name: getattr(defaults, name) for name in SIGLIP_DEFAULTS} == SIGLIP_DEFAULTS
    gemma = transformers.Gemma3Config()
    # the vision fields left out (but Gemma's image and patch sizes: SigLIP's defaults give 14 patches a side)
    ours = gemma3_vision_config({"vision_config": {"image_size": 896, "patch_size": 14}}, "config.json")
    assert (ours.mm_tokens_per_image, ours.image_token_id, ours.boi_token_id, ours.eoi_token_id) == (
        gemma.mm_tokens_per_image, gemma.image_token_id, gemma.boi_token_id, gemma.eoi_token_id)
    assert ours.text_hidden_size == transformers.Gemma3TextConfig().hidden_size


GOOD_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
               "image_size": 56, "patch_size": 14, "model_type": "siglip_vision_model"}


@pytest.mark.parametrize("change,message", [
    ({"vision_config": None}, "no vision_config"),
    ({"vision_config": [1]}, "vision_config must be an object"),
    ({"vision_config": GOOD_VISION | {"patch_size": None}}, "vision_config.patch_size must be a positive integer"),
    ({"vision_config": GOOD_VISION | {"num_hidden_layers": "2"}}, "vision_config.num_hidden_layers must be"),
    ({"vision_config": GOOD_VISION | {"image_size": [56, 28]}}, "vision_config.image_size must be square"),
    ({"vision_config": GOOD_VISION | {"image_size": 50}}, "image_size 50 is not a multiple of patch_size 14"),
    ({"vision_config": GOOD_VISION | {"num_attention_heads": 5}}, "hidden_size 32 is not a multiple of"),
    ({"vision_config": GOOD_VISION | {"hidden_act": "relu"}}, "vision_config.hidden_act 'relu'"),
    ({"vision_config": GOOD_VISION | {"layer_norm_eps": 0}}, "vision_config.layer_norm_eps"),
    ({"vision_config": GOOD_VISION | {"model_type": "clip_vision_model"}}, "vision_config.model_type"),
    ({"mm_tokens_per_image": 5}, "mm_tokens_per_image 5 must be a square"),
    ({"mm_tokens_per_image": 9}, "mm_tokens_per_image 9 must be a square whose side divides the 4 patches"),
    ({"image_token_index": -1}, "image_token_index must be a positive integer"),
    ({"text_config": {"hidden_size": 0}}, "text_config.hidden_size must be a positive integer"),
])
def test_config_errors_name_the_field(change, message):
    config = {"vision_config": GOOD_VISION, "mm_tokens_per_image": 4, "text_config": {"hidden_size": 64}} | change
    with pytest.raises(VisionConfigError, match="config.json") as error:
        gemma3_vision_config(config, "config.json")
    assert message in str(error.value)


@pytest.mark.parametrize("change,message", [
    ({"size": {"height": 224, "width": 224}}, "the vision tower's image_size"),
    ({"do_pan_and_scan": True}, "do_pan_and_scan is not supported"),
    ({"do_resize": False}, "do_resize false is not supported"),
    ({"resample": 9}, "resample 9 is not a Pillow filter"),
    ({"image_mean": [0.5, 0.5]}, "image_mean must be a number or 3 numbers"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std [0.5, 0.0, 0.5] has a zero"),
    ({"rescale_factor": -1}, "rescale_factor must be a positive number"),
])
def test_processor_config_errors_name_the_field(change, message):
    config = {"size": {"height": 56, "width": 56}, "resample": 2} | change
    with pytest.raises(VisionConfigError, match="preprocessor_config.json") as error:
        image_processing(config, 56, "preprocessor_config.json")
    assert message in str(error.value)


def test_bad_weights_and_inputs_are_named(gemma3_vision, tmp_path):
    folder, _ = gemma3_vision
    assert_bad_weights_refused(folder, tmp_path, load_gemma_vision, [
        (lambda tensors: {name: tensor for name, tensor in tensors.items() if "mm_soft_emb_norm" not in name},
         "missing vision tensors: multi_modal_projector.mm_soft_emb_norm"),
        (lambda tensors: tensors | {"vision_tower.post_layernorm.weight": torch.zeros(31)},
         r"vision_tower.post_layernorm.weight has shape \[31\]"),
        (lambda tensors: tensors | {"vision_tower.encoder.layers.5.mlp.fc1.bias": torch.zeros(48)},
         "unexpected vision tensor vision_tower.encoder.layers.5")])
    vision = load_gemma_vision(folder)
    with pytest.raises(ValueError, match=r"pixel_values must be \[images, 3, 56, 56\]; got \[1, 3, 28, 28\]"):
        vision.encode(torch.zeros(1, 3, 28, 28))
    with pytest.raises(ValueError, match="must be floating point"):
        vision.encode(torch.zeros(1, 3, 56, 56, dtype=torch.uint8))
    with pytest.raises(TypeError, match="image 1 is a bytes"):
        preprocess([picture(5, 5, 0), b"png"], ImageProcessing(height=28, width=28))
    with pytest.raises(ValueError, match="no images"):
        preprocess([], ImageProcessing(height=28, width=28))


@pytest.mark.gpu
def test_cuda_bfloat16_encode_follows_transformers(gemma3_vision):
    import transformers

    folder, _ = gemma3_vision
    hf_model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    vision = load_gemma_vision(folder, dtype=torch.bfloat16, device="cuda")
    pixel_values = preprocess(two_pictures(56), vision.processing)
    ours = vision.encode(pixel_values)  # moved to the weights' device by encode
    expected = reference_features(hf_model, pixel_values.cuda().bfloat16())
    assert ours.device.type == "cuda" and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), expected.float(), rtol=0.02, atol=0.05)
