"""Images through the server to a tiny random Qwen3.5 (Qwen3_5ForConditionalGeneration with its vision tower)
served with its real chat template (llama.cpp's Qwen3.5-4B.jinja) and vocabulary (ggml-vocab-qwen35, 151,936
tokens; the vision tokens at the ids Qwen3.5's tokenizer gives them there): the `openai` SDK's chat with two
images of different sizes gets the greedy text and log-probabilities of transformers'
Qwen3_5ForConditionalGeneration given what its Qwen3VLProcessor makes of the same conversation. That processor
needs torchvision for its video half, which this environment lacks, so its image steps are taken here as it
takes them: the conversation rendered by transformers with the template, each image pad repeated once per
merged token, Qwen2VLImageProcessorPil's pixel values and grids. The same request again reports cached tokens
(the images' blocks included) and gives the same answer."""

from __future__ import annotations

import io
import json

import openai
import pytest
from PIL import Image

from tests.helpers.chat_families import family_tokenizer, reference_tokenizer
from tests.helpers.pictures import picture
from tests.helpers.qwen_vision_models import reference_processor, transformers_greedy, write_tiny_qwen3_5_vision
from tests.helpers.server import make_llm, running_server
from tests.helpers.vision_models import data_url, png_file

QWEN35_VOCAB = 151_936
IDS = {"image_token_id": 151_655, "video_token_id": 151_656, "vision_start_token_id": 151_652,
       "vision_end_token_id": 151_653}
IM_END = 151_645
NUM_TOKENS = 6
PICTURES = [png_file(picture(53, 37, seed=1)), png_file(picture(70, 20, seed=2))]  # 35 and 18 tokens
QUESTION = "which of these two pictures is wider?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35-vision")
    hf_model = write_tiny_qwen3_5_vision(folder, ids=IDS, vocab_size=QWEN35_VOCAB, hidden_size=32,
                                         intermediate_size=48)
    tokenizer = family_tokenizer("qwen3.5")
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              **tokenizer.special_tokens_map}))
    (folder / "chat_template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END]}))
    llm = make_llm(folder, num_kv_blocks=64)
    assert llm.vision is not None and llm.vision.marker == "<|image_pad|>"
    with running_server(llm, model_alias="qwen3.5") as server:
        yield hf_model, server


def reference(hf_model, pictures: list[bytes]) -> tuple[str, list[float]]:
    """transformers' greedy answer to one user message of the pictures then QUESTION, and its logprobs."""
    tokenizer = reference_tokenizer("qwen3.5")
    content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": QUESTION}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    images = [Image.open(io.BytesIO(data)) for data in pictures]
    grids = reference_processor()(images=images, return_tensors="pt")["image_grid_thw"]
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(pictures) + 1
    text = pieces[0] + "".join("<|image_pad|>" * (int(grid.prod()) // 4) + piece  # one pad per merged token
                               for grid, piece in zip(grids, pieces[1:]))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens, logprobs = transformers_greedy(hf_model, ids, images, NUM_TOKENS, IDS["image_token_id"])
    return tokenizer.decode(tokens, skip_special_tokens=True), [float(step[token]) for step, token in
                                                                 zip(logprobs, tokens)]


def test_openai_chat_with_two_images_answers_as_transformers_and_hits_the_cache_again(served):
    hf_model, server = served
    expected, logprobs = reference(hf_model, PICTURES)
    content = [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in PICTURES]
    content.append({"type": "text", "text": QUESTION})
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-", max_retries=0) as client:
        answers = [client.chat.completions.create(model="qwen3.5", max_tokens=NUM_TOKENS, temperature=0,
                                                  logprobs=True, reasoning_effort="none",
                                                  messages=[{"role": "user", "content": content}])
                   for _ in range(2)]
    for answer in answers:
        assert answer.choices[0].message.content == expected
        ours = [token.logprob for token in answer.choices[0].logprobs.content]
        assert len(ours) == len(logprobs) and max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3
    assert answers[0].usage.prompt_tokens == 77  # both images' 53 tokens among them
    # the state checkpoint at the last block boundary 8 tokens or more before the prompt's end, past both images
    assert answers[1].usage.prompt_tokens_details.cached_tokens == 64
