"""llama.cpp mmproj files (loading/mmproj.py) against the checkpoint folder they were converted from: a tiny
Gemma3ForConditionalGeneration converted by llama.cpp's own convert_hf_to_gguf.py `--mmproj` (f32, f16,
bf16, q8_0; generated shapes too) gives GemmaVision the folder's config and preprocessing, and the folder
encoder's embeddings (f32: to float rounding, once the projection the converter always stores in f16 is
rounded alike; the others within their rounding); each refusal names the file and the key or tensor; the
plan counts the encoder's weights."""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from localserve.models.vision.preprocess import preprocess

from localserve.loading.mmproj import (
    MmprojError,
    check_language_model,
    image_token_ids,
    load_mmproj_gemma_vision,
    read_mmproj,
)
from localserve.loading.vision import load_gemma_vision
from tests.helpers.gguf_convert import rewrite_gguf, write_spm_tokenizer
from tests.helpers.mmproj_files import convert_mmproj, released_gemma3_layout
from tests.helpers.models import save_random_model
from tests.helpers.pictures import picture, reencoded
from tests.helpers.vision_models import save_processor, tiny_gemma3

TOKEN_IDS = {"boi": 317, "image": 319, "eoi": 318}


@pytest.fixture(scope="module")
def gemma3_pair(tmp_path_factory):
    """The folder (released layout, processor files, a tokenizer) and its mmproj in f32, f16 and q8_0."""
    import transformers

    folder = tmp_path_factory.mktemp("gemma3_mmproj")
    save_random_model(folder, tiny_gemma3(), model_class=transformers.Gemma3ForConditionalGeneration)
    save_processor(folder, 56)
    (folder / "tokenizer.model").write_bytes(spm_tokenizer())
    released_gemma3_layout(folder, mm_tokens_per_image=4)
    files = {outtype: convert_mmproj(folder, folder.parent / f"mmproj-{outtype}.gguf", outtype)
             for outtype in ("f32", "f16", "bf16", "q8_0")}
    return folder, files


@cache
def spm_tokenizer() -> bytes:
    """A tokenizer.model of 320 pieces (the converter's need; trained once)."""
    with tempfile.TemporaryDirectory() as folder:
        write_spm_tokenizer(Path(folder), 320)
        return (Path(folder) / "tokenizer.model").read_bytes()


def pictures() -> list:
    return [reencoded(picture(69, 51, seed=1), "PNG"), reencoded(picture(40, 90, seed=2, mode="RGBA"), "PNG")]


def f16_projection(vision) -> None:
    """The folder encoder's projection rounded to f16, as llama.cpp's converter stores it in every outtype."""
    weight = vision.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        weight.copy_(weight.half().float())


def test_f32_mmproj_gives_the_folder_encoders_embeddings(gemma3_pair):
    folder, files = gemma3_pair
    reference = load_gemma_vision(folder)
    mmproj = read_mmproj(files["f32"])
    assert mmproj.projector == "gemma3"
    vision = load_mmproj_gemma_vision(mmproj, TOKEN_IDS)
    config, expected = vision.config, reference.config
    assert (config.mm_tokens_per_image, config.text_hidden_size, config.placeholder_ids()) == (
        expected.mm_tokens_per_image, expected.text_hidden_size, expected.placeholder_ids())
    assert config.vision.layer_norm_eps == pytest.approx(expected.vision.layer_norm_eps, rel=1e-6)
    assert config.vision == type(config.vision)(**{**vars(expected.vision),
                                                  "layer_norm_eps": config.vision.layer_norm_eps})
    pixel_values = preprocess(pictures(), reference.processing)
    assert torch.equal(preprocess(pictures(), vision.processing), pixel_values)  # the metadata's mean and std
    f16_projection(reference)
    ours, wanted = vision.encode(pixel_values), reference.encode(pixel_values)
    assert ours.shape == (2, 4, 64) and (wanted[0] - wanted[1]).abs().max() > 0.1
    torch.testing.assert_close(ours, wanted, rtol=0, atol=2e-5)


@pytest.mark.parametrize("outtype,atol", [("f16", 0.02), ("bf16", 0.1), ("q8_0", 0.1)])
def test_rounded_mmproj_follows_the_folder_encoder(gemma3_pair, outtype, atol):
    folder, files = gemma3_pair
    reference = load_gemma_vision(folder)
    kinds = {tensor.tensor_type.name for tensor in gguf.GGUFReader(files[outtype]).tensors}
    assert outtype.upper() in kinds  # the file really holds rounded tensors
    vision = load_mmproj_gemma_vision(read_mmproj(files[outtype]), TOKEN_IDS)
    pixel_values = preprocess(pictures(), reference.processing)
    ours, wanted = vision.encode(pixel_values), reference.encode(pixel_values)
    torch.testing.assert_close(ours, wanted, rtol=0, atol=atol)
    assert (ours - wanted).abs().max() > 0  # rounded, yet close


def test_bfloat16_load(gemma3_pair):
    folder, files = gemma3_pair
    vision = load_mmproj_gemma_vision(read_mmproj(files["f16"]), TOKEN_IDS, dtype=torch.bfloat16)
    assert {param.dtype for param in vision.parameters()} == {torch.bfloat16}
    reference = load_gemma_vision(folder)
    pixel_values = preprocess(pictures(), reference.processing)
    torch.testing.assert_close(vision.encode(pixel_values).float(), reference.encode(pixel_values), rtol=0.02,
                               atol=0.1)


def test_image_token_ids_by_text():
    tokens = {"<pad>": 0, "<start_of_image>": 1, "a": 2, "<end_of_image>": 3, "<image_soft_token>": 4}
    wanted = {"boi": "<start_of_image>", "image": "<image_soft_token>", "eoi": "<end_of_image>"}
    assert image_token_ids(tokens, wanted, "lm.gguf") == {"boi": 1, "image": 4, "eoi": 3}
    with pytest.raises(MmprojError, match="lm.gguf: the vocabulary has no <image_soft_token> token"):
        image_token_ids({"<start_of_image>": 1, "<end_of_image>": 3}, wanted, "lm.gguf")


def test_language_model_checks(gemma3_pair):
    _, files = gemma3_pair
    mmproj = read_mmproj(files["f32"])
    check_language_model(mmproj, "gemma3", 64, "lm.gguf")
    with pytest.raises(MmprojError, match=r"mmproj-f32.gguf: clip.vision.projection_dim 64 does not match the "
                                          r"hidden size 128 of lm.gguf"):
        check_language_model(mmproj, "gemma3", 128, "lm.gguf")
    with pytest.raises(MmprojError, match="a gemma3 projector feeds a gemma3 language model; lm.gguf is a qwen35"):
        check_language_model(mmproj, "qwen35", 64, "lm.gguf")


def rewritten(source, out, change=lambda name, values: None, metadata=None, architecture=None):
    return rewrite_gguf(source, out, change, metadata=metadata, architecture=architecture)


@pytest.mark.parametrize("metadata,message", [
    ({"clip.projector_type": "llava"}, "clip.projector_type 'llava' is not served; served: gemma3, qwen3vl_merger, "
                                      "pixtral"),
    ({"clip.has_vision_encoder": False}, "clip.has_vision_encoder is not true"),
    ({"clip.vision.attention.head_count": 5}, "clip.vision.embedding_length 32 is not a multiple of clip"),
    ({"clip.vision.image_size": 50}, "clip.vision.image_size 50 is not a multiple of clip.vision.patch_size 14"),
    ({"clip.use_gelu": False}, "clip.use_gelu is not true"),
    ({"clip.vision.projector.scale_factor": 3}, "clip.vision.projector.scale_factor 3 must be a positive integer"),
    ({"clip.vision.image_std": [0.5, 0.0, 0.5]}, r"clip.vision.image_std \[0.5, 0.0, 0.5\] has a zero"),
    ({"clip.vision.block_count": 3}, "missing tensors for vision_tower.encoder.layers.2"),
    ({"clip.vision.block_count": 1}, "unexpected tensor v.blk.1.ln1.bias"),
    ({"clip.vision.embedding_length": 64}, r"mm.input_projection.weight has shape \[32, 64\]; the metadata gives \["),
])
def test_bad_metadata_is_named(gemma3_pair, tmp_path, metadata, message):
    _, files = gemma3_pair
    path = rewritten(files["f32"], tmp_path / "bad.gguf", metadata=metadata)
    with pytest.raises(MmprojError, match="bad.gguf: " + message):
        load_mmproj_gemma_vision(read_mmproj(path), TOKEN_IDS)


def test_bad_files_are_named(gemma3_pair, tmp_path):
    folder, files = gemma3_pair
    with pytest.raises(MmprojError, match="none.gguf: no such mmproj file"):
        read_mmproj(tmp_path / "none.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(MmprojError, match="junk.gguf: cannot read GGUF"):
        read_mmproj(tmp_path / "junk.gguf")
    text = rewritten(files["f32"], tmp_path / "text.gguf", architecture="gemma3")
    with pytest.raises(MmprojError, match="text.gguf: not an mmproj file: general.architecture is 'gemma3'"):
        read_mmproj(text)
    dropped = rewritten(files["f32"], tmp_path / "dropped.gguf",
                        change=lambda name, values: [] if name == "mm.soft_emb_norm.weight" else None)
    with pytest.raises(MmprojError, match="dropped.gguf: missing tensors for multi_modal_projector.mm_soft_emb_norm"):
        load_mmproj_gemma_vision(read_mmproj(dropped), TOKEN_IDS)
    extra = rewritten(files["f32"], tmp_path / "extra.gguf", change=lambda name, values: [
        (name, values, gguf.GGMLQuantizationType.F32), ("v.blk.0.attn_qkv.weight", np.zeros((96, 32), np.float32),
                                                        gguf.GGMLQuantizationType.F32)] if name == "v.post_ln.bias"
        else None)
    with pytest.raises(MmprojError, match="extra.gguf: unexpected tensor v.blk.0.attn_qkv.weight for a gemma3"):
        load_mmproj_gemma_vision(read_mmproj(extra), TOKEN_IDS)


@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.generate])
@given(patch=st.sampled_from([7, 14]), patches_per_side=st.sampled_from([2, 4, 6]), data=st.data(),
       layers=st.integers(1, 2), heads=st.sampled_from([2, 4]), outtype=st.sampled_from(["f32", "f16"]))
def test_generated_shapes_through_the_converter(tmp_path_factory, patch, patches_per_side, data, layers, heads,
                                                outtype):
    """Tower and pooling shapes drawn (tokens per side: any divisor of the patches per side), converted by
    llama.cpp's converter, give the folder encoder's config and embeddings."""
    import transformers

    side = data.draw(st.sampled_from([d for d in range(1, patches_per_side + 1) if patches_per_side % d == 0]))
    folder = tmp_path_factory.mktemp("generated")
    config = tiny_gemma3(image_size=patch * patches_per_side, mm_tokens=side * side, layers=layers)
    config.vision_config.patch_size, config.vision_config.num_attention_heads = patch, heads  # tiny_gemma3's: 14, 4
    save_random_model(folder, config, seed=side, model_class=transformers.Gemma3ForConditionalGeneration)
    save_processor(folder, patch * patches_per_side)
    (folder / "tokenizer.model").write_bytes(spm_tokenizer())
    released_gemma3_layout(folder, mm_tokens_per_image=side * side)
    reference = load_gemma_vision(folder)
    vision = load_mmproj_gemma_vision(read_mmproj(convert_mmproj(folder, folder / "mmproj.gguf", outtype)), TOKEN_IDS)
    assert (vision.config.mm_tokens_per_image, vision.config.vision.num_heads, vision.config.vision.patch_size) == (
        side * side, heads, patch)
    pixel_values = preprocess(pictures(), reference.processing)
    f16_projection(reference)
    torch.testing.assert_close(vision.encode(pixel_values), reference.encode(pixel_values), rtol=0,
                               atol=2e-5 if outtype == "f32" else 0.02)


@pytest.mark.gpu
def test_cuda_bfloat16_load_follows_the_folder_encoder(gemma3_pair):
    folder, files = gemma3_pair
    vision = load_mmproj_gemma_vision(read_mmproj(files["f16"]), TOKEN_IDS, dtype=torch.bfloat16, device="cuda")
    assert {param.device.type for param in vision.parameters()} == {"cuda"}
    reference = load_gemma_vision(folder)
    pixel_values = preprocess(pictures(), reference.processing)
    ours = vision.encode(pixel_values)
    assert ours.device.type == "cuda" and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float().cpu(), reference.encode(pixel_values), rtol=0.02, atol=0.1)


def test_plan_counts_the_mmproj_weights(gemma3_pair, capsys):
    from localserve.cli import main
    from localserve.kv.memory_plan import human_size

    folder, files = gemma3_pair
    parameters = sum(param.numel() for param in load_gemma_vision(folder).parameters())
    config = Path(__file__).parents[1] / "helpers" / "llama31_8b_config.json"  # a model the plan's formats fit
    assert main(["plan", "-m", str(config), "--vram", "24GB", "--mmproj", str(files["q8_0"])]) == 0
    assert f" + mmproj {human_size(parameters * 2)})" in capsys.readouterr().out
    assert main(["plan", "-m", str(config), "--vram", "24GB", "--mmproj", str(folder / "none.gguf")]) == 2
    assert "none.gguf: no such mmproj file" in capsys.readouterr().err


def test_a_window_shorter_than_an_image_is_served(gemma3_pair):
    """The engine's mask is exact under a window shorter than an image (tests/engine/test_gemma3_image_mask.py)."""
    from localserve.models.config import ModelConfig

    from localserve.loading.mmproj_encoders import load_mmproj_encoder

    _, files = gemma3_pair
    vocabulary = {"<start_of_image>": 317, "<end_of_image>": 318, "<image_soft_token>": 319}
    config = ModelConfig(architecture="Gemma3ForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=96,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=3)
    encoder = load_mmproj_encoder(read_mmproj(files["f32"]), Path("lm.gguf"), config, "gemma3", vocabulary,
                                  torch.float32, "cpu")
    prepared = encoder.prepare(picture(30, 20, seed=4))
    assert prepared.span_ids == (319,) * 4 and encoder.encode(prepared).shape == (4, 64)
