"""Gemma 3's `ImageEncoder` (models/vision/gemma3_encoder.py) and what loads it: for a tiny Gemma 3 checkpoint
folder, transformers' Gemma3Processor gives the same prompt ids (the template's marker expanded by the tokenizer's
`expand`) and pixel values, and `get_image_features` the same embeddings; `LLM.vision` is the encoder for the folder
and None for a text model, and the load's log says which (never that a loaded tower is left out); what the loader
refuses, by name. `ImageInput.picture()` and `encode_chat(expand=)` too."""

from __future__ import annotations

import hashlib
import io
import json
import logging

import pytest
import torch
from PIL import Image

from localserve.engine.image_prompt import ImagePrompt
from localserve.llm import load_vision
from localserve.loading.image_encoders import load_image_encoder
from localserve.loading.vision import VisionLoadError
from localserve.server.request.images import ImageBounds, PlacedImage, decode_image, with_image_parts
from localserve.tokenizer.tokenizer import Tokenizer
from tests.helpers.pictures import picture
from tests.helpers.vision_models import IMAGE_ID, reference_processor, write_tiny_gemma3_vision


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3"), seed=1, mm_tokens_per_image=4)


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def encoder_of(folder):
    return load_image_encoder(folder, config_of(folder), torch.float32, "cpu")


def file_of(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def test_prompt_pixels_and_embeddings_are_transformers(folder):
    import transformers

    encoder = encoder_of(folder)
    assert encoder.marker == "<start_of_image>" and encoder.hidden_size == 64
    image = picture(45, 31, seed=4, mode="RGBA")
    prepared = encoder.prepare(image)
    assert prepared.span_ids == (IMAGE_ID,) * 4 and prepared.bidirectional
    processor = reference_processor(folder)
    text = "what is this?"
    expected = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}],
        tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt")
    tokenizer = Tokenizer.from_hf_folder(folder)
    messages = with_image_parts([{"role": "user", "content": text}], [PlacedImage(0, 0, None)])
    prompt = ImagePrompt(encoder, (b"hash",), (prepared,))
    ids = tokenizer.encode_chat(messages, expand=prompt.expand)
    assert ids == expected["input_ids"][0].tolist()
    assert [i for i, token in enumerate(ids) if token == IMAGE_ID] == \
        [i for i, kind in enumerate(expected["token_type_ids"][0].tolist()) if kind == 1]
    # A marker the user typed stays text (transformers' processor would take it for an image and refuse)
    typed = with_image_parts([{"role": "user", "content": "a <start_of_image> typed"}], [PlacedImage(0, 0, None)])
    typed_ids = tokenizer.encode_chat(typed, expand=prompt.expand)
    assert typed_ids.count(IMAGE_ID) == 4 and "a <start_of_image> typed" in tokenizer.decode(typed_ids)
    assert torch.equal(prepared.inputs, expected["pixel_values"])
    hf_model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf_model.get_image_features(expected["pixel_values"], return_dict=True).pooler_output[0]
    ours = encoder.encode(prepared)
    assert ours.shape == (4, 64) and (ours - theirs).abs().max() < 1e-5


def test_a_window_shorter_than_an_image_is_served(folder):
    """The engine's mask is exact there too (tests/engine/test_gemma3_image_mask.py, a window of 8 under images of
    16 tokens): the loader does not refuse it."""
    config = config_of(folder)
    config["text_config"]["sliding_window"] = 3
    encoder = load_image_encoder(folder, config, torch.float32, "cpu")
    assert encoder.prepare(picture(30, 20, seed=4)).span_ids == (IMAGE_ID,) * 4


def test_the_loader_names_an_image_token_the_tokenizer_lacks(folder):
    config = config_of(folder) | {"image_token_index": 4000}
    with pytest.raises(VisionLoadError, match=r"image_token_index 4000 is not a token of the tokenizer"):
        load_image_encoder(folder, config, torch.float32, "cpu")


def test_vision_is_loaded_beside_the_model_and_the_log_says_so(folder, tmp_path, caplog):
    from localserve.llm import LLM

    with caplog.at_level(logging.INFO):
        llm = LLM(str(folder), device="cpu")
    assert llm.vision is not None and llm.vision.marker == "<start_of_image>"
    assert "vision encoder is loaded" in caplog.text and "left unloaded" not in caplog.text
    text_only = {key: value for key, value in config_of(folder).items() if key != "vision_config"}
    assert load_image_encoder(folder, text_only, torch.float32, "cpu") is None
    assert load_vision(tmp_path / "model.gguf", torch.float32, "cpu") is None  # a file: no folder encoder


def test_picture_is_the_first_frame_as_decoded():
    palette = picture(20, 12, seed=2, mode="P_transparent")
    data = file_of(palette, "PNG", transparency=3)
    image = decode_image(data, "part", ImageBounds())
    shown = image.picture()
    assert shown.mode == "P" and shown.info.get("transparency") == 3 and shown.size == (20, 12)
    frames = [picture(10, 8, seed=seed) for seed in range(2)]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    first = decode_image(gif.getvalue(), "part", ImageBounds()).picture()
    with Image.open(io.BytesIO(gif.getvalue())) as opened:
        assert first.tobytes() == opened.tobytes() and first.mode == opened.mode


def test_encode_chat_expands_the_rendered_text_in_both_paths(folder):
    tokenizer = Tokenizer.from_hf_folder(folder)
    seen = []

    def expand(text: str) -> str:
        seen.append(text)
        return text.replace("cat", "dog")

    for typed in ("a cat", "a cat <end_of_turn>"):
        ids = tokenizer.encode_chat([{"role": "user", "content": typed}], expand=expand)
        assert tokenizer.decode(ids, skip_special_tokens=False).count("dog") == 1
    assert seen[0].count("<end_of_turn>") == seen[1].count("<end_of_turn>") == 1  # typed: a placeholder then


def test_a_save_without_its_vision_tensors_is_served_as_text(folder, tmp_path, caplog):
    import shutil

    from safetensors.torch import load_file, save_file

    from localserve.llm import LLM

    shutil.copytree(folder, tmp_path / "text", ignore=shutil.ignore_patterns("*.safetensors*"))
    [shard] = folder.glob("*.safetensors")
    tensors = {name: tensor for name, tensor in load_file(shard).items() if "vision" not in name
               and "multi_modal_projector" not in name}
    save_file(tensors, tmp_path / "text" / shard.name, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tmp_path / "text"), device="cpu")
    assert llm.vision is None and "its vision tower is left unloaded" in caplog.text


def test_pictures_that_differ_only_in_transparency_are_different_pictures(folder):
    """Their colours agree, their alpha does not: laid over white they differ, so their hashes (the prefix
    cache's and the embedding cache's keys) must too; opaque pictures keep the hash of their RGB pixels."""
    encoder = encoder_of(folder)
    opaque = picture(16, 12, seed=3)
    faint, fainter = opaque.convert("RGBA"), opaque.convert("RGBA")
    faint.putalpha(200)
    fainter.putalpha(100)
    inputs = [decode_image(file_of(image), "part", ImageBounds()) for image in (opaque, faint, fainter)]
    assert len({image.sha256 for image in inputs}) == 3
    assert not torch.equal(encoder.prepare(faint).inputs, encoder.prepare(fainter).inputs)
    assert inputs[0].sha256 == hashlib.sha256(b"16x12:" + opaque.tobytes()).digest()
    palette = picture(16, 12, seed=3, mode="P_transparent")
    other = palette.copy()
    other.info["transparency"] = 4
    assert decode_image(file_of(palette, transparency=3), "p", ImageBounds()).sha256 != decode_image(
        file_of(other, transparency=4), "q", ImageBounds()).sha256
