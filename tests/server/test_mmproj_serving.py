"""A GGUF vision pair served (`LLM(model.gguf, mmproj=mmproj.gguf)`, what `localserve serve -m ... --mmproj ...`
loads): a tiny random Gemma 3 folder converted by llama.cpp's own convert_hf_to_gguf.py into its language model
(f32) and its mmproj (f32, and f16), sent an image by the openai SDK, answers with the greedy text of the same
folder served. The folder's projection is rounded to f16 first (the converter stores it so in every outtype), so
the f32 pair carries the folder's weights; its tokenizer gets a sentencepiece twin (the converter reads Gemma 3's
vocabulary from tokenizer.model). What a pair refuses, at start, naming the files."""

from __future__ import annotations

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from localserve.loading.mmproj import MmprojError
from tests.helpers.gemma_models import gemma3_config
from tests.helpers.gguf_convert import convert, rewrite_gguf
from tests.helpers.mmproj_files import convert_mmproj, released_gemma3_layout, write_sentencepiece_twin
from tests.helpers.pictures import picture
from tests.helpers.server import make_llm, running_server
from tests.helpers.vision_models import VOCAB_SIZE, data_url, png_file, write_tiny_gemma3_vision

NUM_TOKENS = 6
QUESTION = "what is in this picture?"


def png(seed: int) -> bytes:
    return png_file(picture(40, 30, seed=seed))


def round_projection_to_f16(folder) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    name = next(name for name in tensors if name.endswith("mm_input_projection_weight"))
    tensors[name] = tensors[name].half().float()
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the folder, its language model .gguf, its mmproj in f32 and f16)."""
    # what llama.cpp's Gemma 3 GGUFs assume, keeping neither: one text layer, a sliding one (it reads the first of
    # every 6 as sliding), and query_pre_attn_scalar the head size
    text = gemma3_config(num_hidden_layers=1, sliding_window_pattern=2, final_logit_softcapping=None,
                         vocab_size=VOCAB_SIZE, query_pre_attn_scalar=16)
    folder = write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3_pair"), seed=3, mm_tokens_per_image=1,
                                      text_config=text)
    round_projection_to_f16(folder)
    write_sentencepiece_twin(folder)
    released_gemma3_layout(folder, mm_tokens_per_image=1)
    model = convert(folder, folder.parent / "gemma3-pair.gguf", "--outtype", "f32")
    mmproj = {outtype: convert_mmproj(folder, folder.parent / f"mmproj-gemma3-pair-{outtype}.gguf", outtype)
              for outtype in ("f32", "f16")}
    return folder, model, mmproj


def make_pair_llm(model, mmproj):
    from localserve.engine.config import EngineConfig
    from localserve.llm import LLM

    config = EngineConfig(num_kv_blocks=64, max_num_seqs=16, max_num_batched_tokens=256)
    return LLM(str(model), device="cpu", engine_config=config, mmproj=mmproj)


def chat_answers(llm, pictures: list[bytes]) -> list[str]:
    answers = []
    with running_server(llm, model_alias="served") as server, openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-", max_retries=0) as client:
        for data in pictures:
            url = data_url(data)
            chat = client.chat.completions.create(model="served", max_tokens=NUM_TOKENS, temperature=0, messages=[
                {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                             {"type": "image_url", "image_url": {"url": url}}]}])
            answers.append(chat.choices[0].message.content)
    return answers


def test_the_pair_answers_as_the_folder(pair):
    folder, model, mmproj = pair
    pictures = [png(1), png(2)]
    folder_llm = make_llm(folder, num_kv_blocks=64)
    expected = chat_answers(folder_llm, pictures)
    assert expected[0] != expected[1]  # the picture matters
    prepared = folder_llm.vision.prepare(picture(40, 30, seed=1))
    wanted = folder_llm.vision.encode(prepared)
    del folder_llm
    pair_llm = make_pair_llm(model, mmproj["f32"])
    vision = pair_llm.vision
    assert (vision.marker, vision.hidden_size) == ("<start_of_image>", 64)
    ours = vision.prepare(picture(40, 30, seed=1))
    assert (ours.text, ours.span_ids, ours.bidirectional) == (prepared.text, prepared.span_ids, True)
    assert torch.equal(ours.inputs, prepared.inputs)
    torch.testing.assert_close(vision.encode(ours), wanted, rtol=0, atol=2e-5)
    assert chat_answers(pair_llm, pictures) == expected


def test_the_f16_mmproj_answers_as_the_folder(pair):
    folder, model, mmproj = pair
    expected = chat_answers(make_llm(folder, num_kv_blocks=64), [png(1)])
    assert chat_answers(make_pair_llm(model, mmproj["f16"]), [png(1)]) == expected


def test_a_pair_that_cannot_be_served_is_refused_naming_the_files(pair, tmp_path):
    folder, model, mmproj = pair
    with pytest.raises(MmprojError, match=f"{folder} is not one"):
        make_pair_llm(folder, mmproj["f32"])
    with pytest.raises(MmprojError, match="gemma3-pair.gguf: not an mmproj file: general.architecture is 'gemma3'"):
        make_pair_llm(model, model)
    wide = rewrite_gguf(mmproj["f32"], tmp_path / "wide.gguf", metadata={"clip.vision.projection_dim": 128})
    with pytest.raises(MmprojError, match=r"wide.gguf: clip.vision.projection_dim 128 does not match the hidden size "
                                          r"64 of .*gemma3-pair.gguf"):
        make_pair_llm(model, wide)
    # from the model's header, before its weights load (a "llama" file with Gemma's keys would not load at all)
    other = rewrite_gguf(model, tmp_path / "other-lm.gguf", architecture="llama")
    with pytest.raises(MmprojError, match="a gemma3 projector feeds a gemma3 language model; .*other-lm.gguf is a "
                                          "llama model"):
        make_pair_llm(other, mmproj["f32"])
    renamed = rewrite_gguf(model, tmp_path / "renamed-lm.gguf", metadata={
        "tokenizer.ggml.tokens": ["<unused>" if token == "<image_soft_token>" else token for token in
                                  __import__("gguf").GGUFReader(model).fields["tokenizer.ggml.tokens"].contents()]})
    with pytest.raises(MmprojError, match="renamed-lm.gguf: the vocabulary has no <image_soft_token> token"):
        make_pair_llm(renamed, mmproj["f32"])


def test_serve_loads_the_pair_for_its_model_only(pair, tmp_path):
    """What `localserve serve -m model.gguf --mmproj FILE --models-dir DIR` loads: the pair for the -m model
    (cli.py's `mmproj_pair`), the other models of the catalog without one; an mmproj file in DIR is no model."""
    import argparse
    import shutil

    from localserve.cli import mmproj_pair
    from localserve.engine.config import EngineConfig
    from localserve.model_loader import EngineLoader, find_models

    folder, model, mmproj = pair
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(model, other / "text-twin.gguf")
    shutil.copy(mmproj["f16"], other / "mmproj-text-twin.gguf")  # llama.cpp's layout: not listed as a model
    args = argparse.Namespace(mmproj=mmproj["f16"], model=[str(model)])
    found = find_models([str(model)], other)
    load = EngineLoader(EngineConfig(num_kv_blocks=64, max_num_batched_tokens=256), torch.float32, "cpu",
                        mmproj=mmproj_pair(args))
    first, second = found.catalog.entries  # the mmproj beside the twin is not one of them
    for entry, takes_images in ((first, True), (second, False)):
        loaded = load(entry)
        try:
            assert (loaded.vision is not None) == takes_images, entry.files.path
        finally:
            loaded.unload()
