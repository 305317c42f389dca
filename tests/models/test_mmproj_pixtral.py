"""Mistral 3's mmproj (loading/mmproj_pixtral.py) against the checkpoint folder it was converted from: a tiny
Mistral3ForConditionalGeneration converted by llama.cpp's own convert_hf_to_gguf.py `--mmproj` (f32, f16)
gives Mistral3Vision the folder's config and processing and the folder encoder's embeddings for pictures of
several sizes at once; the pair's ImageEncoder (the row break's embedding from the file's
`v.token_embd.img_break` where it has one) gives the folder encoder's text, span and embeddings; what is
refused, by name.

The tiny tower has 3 layers: the converter maps `multi_modal_projector.linear_{n}` by a layer index, so a
tower of fewer layers than 3 cannot name `linear_2`. Its image_size is the processor's bound (48), as in the
released checkpoints (the file keeps only the former)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from localserve.models.vision.mistral3_encoder import load_mistral3_encoder
from localserve.models.vision.pixtral_preprocess import pixtral_preprocess

from localserve.loading.mmproj import MmprojError, read_mmproj
from localserve.loading.mmproj_pixtral import (
    BREAK_TENSOR,
    PIXTRAL_IMAGE_TOKENS,
    break_embedding,
    load_mmproj_mistral3_vision,
    pixtral_mmproj_encoder,
)
from localserve.loading.pixtral_vision import load_mistral3_vision, token_embedding
from tests.helpers.gguf import random_blocks
from tests.helpers.gguf_convert import rewrite_gguf
from tests.helpers.mmproj_files import convert_mmproj
from tests.helpers.pictures import picture, reencoded
from tests.helpers.pixtral_models import IMG, IMG_BREAK, IMG_END, LONGEST_EDGE, write_tiny_mistral3

VISION = {"num_hidden_layers": 3, "image_size": LONGEST_EDGE}
VOCABULARY = {"[IMG]": IMG, "[IMG_BREAK]": IMG_BREAK, "[IMG_END]": IMG_END}


@pytest.fixture(scope="module")
def mistral3_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral3_mmproj")
    write_tiny_mistral3(folder, seed=2, vision=VISION)
    return folder, {outtype: convert_mmproj(folder, folder.parent / f"mmproj-mistral3-{outtype}.gguf", outtype)
                    for outtype in ("f32", "f16")}


def pictures() -> list:
    return [reencoded(picture(53, 37, seed=1), "PNG"), reencoded(picture(70, 20, seed=2, mode="RGBA"), "PNG"),
            picture(5, 9, seed=3)]


def assert_same_embeddings(vision, reference, atol: float) -> None:
    values = [pixtral_preprocess(image, reference.processing) for image in pictures()]
    assert [torch.equal(pixtral_preprocess(image, vision.processing), wanted)
            for image, wanted in zip(pictures(), values)] == [True] * len(values)
    ours, wanted = vision.encode(values), reference.encode(values)
    assert [tuple(x.shape) for x in ours] == [tuple(x.shape) for x in wanted]
    for mine, theirs in zip(ours, wanted):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=atol)


@pytest.mark.parametrize("outtype,atol", [("f32", 2e-5), ("f16", 0.05)])
def test_mmproj_gives_the_folder_encoders_embeddings(mistral3_pair, outtype, atol):
    folder, files = mistral3_pair
    reference = load_mistral3_vision(folder)
    mmproj = read_mmproj(files[outtype])
    assert mmproj.projector == "pixtral"
    vision = load_mmproj_mistral3_vision(mmproj, IMG)
    assert vision.config == reference.config and vision.processing == reference.processing
    assert_same_embeddings(vision, reference, atol)
    if outtype == "f16":
        [ours], [wanted] = vision.encode([pixtral_preprocess(pictures()[0], vision.processing)]), reference.encode(
            [pixtral_preprocess(pictures()[0], reference.processing)])
        assert (ours - wanted).abs().max() > 0  # the weights were rounded


def with_break_row(source, out, row: torch.Tensor):
    """The mmproj with the row break's embedding, as files from Mistral's format or earlier converters hold it."""
    import gguf

    def change(name, values):
        if name != "mm.1.weight":
            return None
        return [(name, values, gguf.GGMLQuantizationType.F32),
                (BREAK_TENSOR, row.numpy(), gguf.GGMLQuantizationType.F32)]
    return rewrite_gguf(source, out, change)


def test_the_pairs_image_encoder_equals_the_folders(mistral3_pair, tmp_path):
    folder, files = mistral3_pair
    row = token_embedding(folder, IMG_BREAK, torch.float32, "cpu")
    path = with_break_row(files["f32"], tmp_path / "with-break.gguf", row)
    reference = load_mistral3_encoder(folder, json.loads((folder / "config.json").read_text()), torch.float32, "cpu")
    ours = pixtral_mmproj_encoder(read_mmproj(path), tmp_path / "lm.gguf", None, VOCABULARY | {"a": 40},
                                  torch.float32, "cpu")
    assert (ours.marker, ours.hidden_size, ours.tokens) == (reference.marker, reference.hidden_size, reference.tokens)
    assert torch.equal(ours.break_embedding, row)
    for image in pictures()[:2]:
        mine, theirs = ours.prepare(image), reference.prepare(image)
        assert (mine.text, mine.span_ids) == (theirs.text, theirs.span_ids) and torch.equal(mine.inputs, theirs.inputs)
        assert "[IMG_BREAK]" in mine.text
        torch.testing.assert_close(ours.encode(mine), reference.encode(theirs), rtol=0, atol=2e-5)
    assert set(PIXTRAL_IMAGE_TOKENS.values()) == set(VOCABULARY)


def test_pixtral_refusals_are_named(mistral3_pair, tmp_path):
    _, files = mistral3_pair
    source = files["f32"]
    cases = [
        ({"clip.use_silu": False}, "clip.use_silu and clip.use_gelu must name one activation"),
        ({"clip.vision.attention.head_count": 3}, "clip.vision.embedding_length 32 / clip.vision.attention.head_count"),
        ({"clip.vision.block_count": 2}, "unexpected tensor v.blk.2.attn_k.weight for a pixtral projector"),
        ({"clip.vision.projection_dim": 96}, r"mm.1.weight has shape \[64, 32\]; the metadata gives \[96, 32\]"),
        ({"clip.vision.attention.layer_norm_epsilon": 2.0},
         r"clip.vision.attention.layer_norm_epsilon must be a number in \(0, 1\)"),
    ]
    for index, (metadata, message) in enumerate(cases):
        path = rewrite_gguf(source, tmp_path / f"bad{index}.gguf", metadata=metadata)
        with pytest.raises(MmprojError, match=f"bad{index}.gguf: {message}"):
            load_mmproj_mistral3_vision(read_mmproj(path), IMG)
    no_merger = rewrite_gguf(source, tmp_path / "pixtral12b.gguf",
                             change=lambda name, values: [] if name == "mm.patch_merger.weight" else None)
    with pytest.raises(MmprojError, match="pixtral12b.gguf: missing tensor mm.patch_merger.weight"):
        load_mmproj_mistral3_vision(read_mmproj(no_merger), IMG)
    with pytest.raises(MmprojError, match="lm.gguf: the vocabulary has no \\[IMG_BREAK\\] token"):
        pixtral_mmproj_encoder(read_mmproj(source), tmp_path / "lm.gguf", None, {"[IMG]": IMG, "[IMG_END]": IMG_END},
                               torch.float32, "cpu")
    wrong = with_break_row(source, tmp_path / "wrong-break.gguf", torch.ones(32))
    with pytest.raises(MmprojError, match=r"wrong-break.gguf: v.token_embd.img_break has shape \[32\]; the language "
                                          r"model's hidden size is 64"):
        break_embedding(read_mmproj(wrong), tmp_path / "lm.gguf", IMG_BREAK, 64)
    # no img_break in the file: read from the language model
    with pytest.raises(MmprojError, match="lm.gguf: cannot read the language model for the row break's embedding"):
        break_embedding(read_mmproj(source), tmp_path / "lm.gguf", IMG_BREAK, 64)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_K"])
def test_the_break_row_is_read_alone_from_the_language_models_embeddings(mistral3_pair, tmp_path, qtype):
    """Without `v.token_embd.img_break`, row [IMG_BREAK] of the language model's token_embd.weight, in its stored
    type, de-quantized alone, equals that row of the whole table de-quantized."""
    import gguf

    _, files = mistral3_pair
    kind = gguf.GGMLQuantizationType[qtype]
    table = torch.randn(20, 256, generator=torch.Generator().manual_seed(3)).numpy()
    writer = gguf.GGUFWriter(str(tmp_path / "lm.gguf"), "mistral3")
    data = random_blocks(qtype, 20, 256) if qtype.endswith("_K") else gguf.quants.quantize(table, kind)
    writer.add_tensor("token_embd.weight", data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [stored] = gguf.GGUFReader(tmp_path / "lm.gguf").tensors
    wanted = torch.from_numpy(gguf.quants.dequantize(stored.data, kind).reshape(20, 256)[IMG_BREAK].copy())
    row = break_embedding(read_mmproj(files["f32"]), tmp_path / "lm.gguf", IMG_BREAK, 256)
    assert torch.equal(row, wanted.float())
    with pytest.raises(MmprojError, match=r"lm.gguf: token_embd.weight is \[20, 256\]; the row break token 12 of "
                                          r"hidden size 64 is not in it"):
        break_embedding(read_mmproj(files["f32"]), tmp_path / "lm.gguf", IMG_BREAK, 64)


@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.generate])
@given(layers=st.integers(3, 4), heads=st.sampled_from([1, 2]), patch=st.sampled_from([2, 4]),
       merge=st.sampled_from([1, 2]), act=st.sampled_from(["silu", "gelu"]), bias=st.booleans(),
       seed=st.integers(0, 3))
def test_generated_shapes_through_the_converter(tmp_path_factory, layers, heads, patch, merge, act, bias, seed):
    """Tower and projector shapes drawn, converted by llama.cpp's converter (f32), give the folder's embeddings."""
    folder = tmp_path_factory.mktemp("generated_mistral3")
    side = patch * merge * 6
    write_tiny_mistral3(folder, seed=seed, processor=False, spatial_merge_size=merge, multimodal_projector_bias=bias,
                        vision={"num_hidden_layers": layers, "num_attention_heads": heads, "patch_size": patch,
                                "hidden_act": act, "image_size": side})
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "image_mean": [0.3, 0.4, 0.5], "image_std": [0.2, 0.25, 0.3],
        "size": {"longest_edge": side}, "patch_size": {"height": patch * merge, "width": patch * merge}}))
    reference = load_mistral3_vision(folder)
    vision = load_mmproj_mistral3_vision(read_mmproj(convert_mmproj(folder, folder / "mmproj.gguf")), IMG)
    assert vision.config == reference.config and vision.processing == reference.processing
    assert_same_embeddings(vision, reference, 2e-5)
