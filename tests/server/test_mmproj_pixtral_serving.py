"""A Mistral 3 GGUF vision pair served (`LLM(model.gguf, mmproj=mmproj.gguf)`, what `localserve serve -m ...
--mmproj ...` loads): a tiny random Mistral3ForConditionalGeneration folder (tests/helpers/pixtral_models.py's:
Mistral's control tokens at their ids, the real Mistral Small 3.2 chat template, a tower of 3 layers whose
image_size is the processor's bound) converted by llama.cpp's own convert_hf_to_gguf.py into its language model
(f32, `mistral3`) and its mmproj (f32, `pixtral`), sent two pictures of different sizes by the openai SDK,
answers with the greedy text and log-probabilities of the same folder served. This converter leaves the row
break's embedding out of the mmproj of a transformers checkpoint, so the pair reads it from the language
model's token embeddings (loading/mmproj_pixtral.py)."""

from __future__ import annotations

import pytest

from localserve.loading.mmproj_pixtral import BREAK_TENSOR
from tests.helpers.gguf_convert import convert, rewrite_gguf
from tests.helpers.mmproj_files import convert_mmproj
from tests.helpers.mmproj_pairs import assert_pair_answers_as_the_folder, make_pair_llm
from tests.helpers.pictures import picture
from tests.helpers.pixtral_models import LONGEST_EDGE, SPECIALS, VOCAB, write_tiny_mistral3
from tests.helpers.tokenizers import train_bpe
from tests.helpers.vision_models import data_url, png_file

PICTURES = [png_file(picture(53, 37, seed=1)), png_file(picture(20, 44, seed=2, mode="RGBA"))]
QUESTION = "which of these two pictures is wider?"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the folder, its language model .gguf, its mmproj)."""
    folder = tmp_path_factory.mktemp("mistral3_pair")
    # the vocabulary as large as the tokenizer: the converter names ids past it [PADn], which the folder decodes as ""
    write_tiny_mistral3(folder, seed=5, vision={"num_hidden_layers": 3, "image_size": LONGEST_EDGE},
                        text={"vocab_size": train_bpe(SPECIALS, VOCAB).get_vocab_size()})
    # the converter names a BPE pre-tokenizer by a hash no tiny tokenizer matches: told GPT-2's, train_bpe's split
    model = convert(folder, folder.parent / "mistral3-pair.gguf", "--outtype", "f32", pre_tokenizer="gpt2")
    return folder, model, convert_mmproj(folder, folder.parent / "mmproj-mistral3-pair-f32.gguf")


def test_the_mistral3_pair_answers_as_the_folder(pair):
    import gguf

    folder, model, mmproj = pair
    assert BREAK_TENSOR not in {tensor.name for tensor in gguf.GGUFReader(mmproj).tensors}
    content = [{"type": "text", "text": QUESTION}]
    content += [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in PICTURES]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    prompt_tokens = assert_pair_answers_as_the_folder(folder, model, mmproj, "[IMG]", messages)
    assert prompt_tokens > 30 + 18  # both pictures' tokens among them (5 x 6 and 6 x 3 with their breaks)


def test_a_mistral3_pair_that_cannot_be_served_is_refused_naming_the_files(pair, tmp_path):
    from localserve.loading.mmproj import MmprojError

    _, model, mmproj = pair
    wide = rewrite_gguf(mmproj, tmp_path / "wide.gguf", metadata={"clip.vision.projection_dim": 128})
    with pytest.raises(MmprojError, match=r"wide.gguf: clip.vision.projection_dim 128 does not match the hidden size "
                                          r"64 of .*mistral3-pair.gguf"):
        make_pair_llm(model, wide)
    other = rewrite_gguf(model, tmp_path / "other-lm.gguf", architecture="gemma3")
    with pytest.raises(MmprojError, match="a pixtral projector feeds a mistral3 or llama language model; "
                                          ".*other-lm.gguf is a gemma3 model"):
        make_pair_llm(other, mmproj)
