"""A Qwen3.5 GGUF vision pair served (`LLM(model.gguf, mmproj=mmproj.gguf)`, what `localserve serve -m ...
--mmproj ...` loads): a tiny random Qwen3_5ForConditionalGeneration folder (the hybrid language model with
interleaved mRoPE sections, its vision tower, Qwen3.5's real chat template over a small byte-level BPE whose
first ids are Qwen's special and vision tokens) converted by llama.cpp's own convert_hf_to_gguf.py into its
language model (f32; the mRoPE sections read back from `qwen35.rope.dimension_sections`) and its mmproj (f32),
sent two images of different sizes by the openai SDK, answers with the greedy text and log-probabilities of the
same folder served. The folder's processor takes llama.cpp's pixel bounds for this projector (8 to 4096 image
tokens; the mmproj keeps none), so both make the same tokens of a picture."""

from __future__ import annotations

import json

import pytest

from tests.helpers.gguf_convert import convert, write_bpe_tokenizer
from tests.helpers.llama_cpp_files import template_text
from tests.helpers.mmproj_files import convert_mmproj
from tests.helpers.mmproj_pairs import assert_pair_answers_as_the_folder
from tests.helpers.pictures import picture
from tests.helpers.qwen_vision_models import MERGE, MROPE_SECTION, PATCH, custom_processor, write_tiny_qwen3_5_vision
from tests.helpers.tokenizers import train_bpe
from tests.helpers.vision_models import data_url, png_file

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
IDS = {"image_token_id": SPECIALS.index("<|image_pad|>"), "video_token_id": SPECIALS.index("<|video_pad|>"),
       "vision_start_token_id": SPECIALS.index("<|vision_start|>"),
       "vision_end_token_id": SPECIALS.index("<|vision_end|>")}
TOKEN_PIXELS = (PATCH * MERGE) ** 2
PICTURES = [png_file(picture(53, 37, seed=1)), png_file(picture(70, 20, seed=2))]
QUESTION = "which of these two pictures is wider?"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the folder, its language model .gguf, its mmproj)."""
    folder = tmp_path_factory.mktemp("qwen35_pair")
    # the vocabulary as large as the tokenizer: the converter names ids past it [PADn], which the folder decodes as ""
    write_tiny_qwen3_5_vision(folder, ids=IDS, seed=4, vocab_size=train_bpe(SPECIALS, 320).get_vocab_size())
    custom_processor(size={"shortest_edge": 8 * TOKEN_PIXELS, "longest_edge": 4096 * TOKEN_PIXELS}
                     ).save_pretrained(folder)
    write_bpe_tokenizer(folder, 320, SPECIALS)
    (folder / "chat_template.jinja").write_text(template_text("Qwen3.5-4B.jinja"), encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [SPECIALS.index("<|im_end|>")]}))
    # the converter names a BPE pre-tokenizer by a hash no tiny tokenizer matches: told GPT-2's, train_bpe's split
    model = convert(folder, folder.parent / "qwen35-pair.gguf", "--outtype", "f32", "--no-mtp", pre_tokenizer="gpt2")
    return folder, model, convert_mmproj(folder, folder.parent / "mmproj-qwen35-pair-f32.gguf")


def test_the_qwen35_pair_answers_as_the_folder(pair):
    from localserve.loading.hf import read_model_config

    folder, model, mmproj = pair
    sections = [read_model_config(path)[0].rope.mrope_section for path in (folder, model)]
    assert sections == [tuple(MROPE_SECTION)] * 2  # the GGUF's rope.dimension_sections, not the default
    content = [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in PICTURES]
    content.append({"type": "text", "text": QUESTION})
    prompt_tokens = assert_pair_answers_as_the_folder(folder, model, mmproj, "<|image_pad|>",
                                                      [{"role": "user", "content": content}], reasoning_effort="none")
    assert prompt_tokens > 35 + 27  # both pictures' tokens among them
