"""The offline API with images: `LLM.chat` on a tiny Gemma 3 takes transformers' image parts and gives
transformers' greedy tokens (Gemma3ForConditionalGeneration given what its Gemma3Processor makes of the same
folder, pictures and text); two conversations with other pictures batched answer as each alone; what it refuses,
by name (an image to a text model, a part that is no picture, a template that drops images)."""

from __future__ import annotations

import pytest
import torch

from localserve.engine.config import EngineConfig
from localserve.engine.image_prompt import ImageCountError
from localserve.engine.sampling_params import SamplingParams
from localserve.llm import LLM
from tests.helpers.pictures import picture
from tests.helpers.vision_models import reference_processor, write_tiny_gemma3_vision

NUM_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)


def conversation(*pictures, text: str = "what is in it?") -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": image} for image in pictures),
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module", params=[1, 4], ids=["1-token", "4-tokens"])
def gemma3(request, tmp_path_factory):
    folder = write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3"), seed=11, mm_tokens_per_image=request.param)
    config = EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    return folder, LLM(str(folder), device="cpu", engine_config=config)


def reference_tokens(folder, messages: list[dict]) -> tuple[list[int], list[float]]:
    import transformers

    processor = reference_processor(folder)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                           return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [float(torch.log_softmax(logits[0].double(), -1)[token]) for logits, token in zip(out.logits, tokens)]
    return tokens, logprobs


def test_chat_with_pictures_gives_transformers_tokens(gemma3):
    folder, llm = gemma3
    messages = conversation(picture(33, 47, seed=1), picture(20, 20, seed=2, mode="RGBA"))
    expected, logprobs = reference_tokens(folder, messages)
    [output] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logprobs=0))
    sample = output.outputs[0]
    assert sample.token_ids == expected
    assert max(abs(a - b) for a, b in zip(sample.logprobs, logprobs)) < 1e-3


def test_pictures_batched_answer_as_alone(gemma3):
    _, llm = gemma3
    conversations = [conversation(picture(30, 30, seed=seed)) for seed in (3, 4, 5)]
    alone = [llm.chat(messages, GREEDY)[0].outputs[0].token_ids for messages in conversations]
    together = [output.outputs[0].token_ids for output in llm.chat(conversations, GREEDY)]
    assert together == alone


def test_what_chat_refuses(gemma3, tmp_path):
    folder, llm = gemma3
    with pytest.raises(TypeError, match="image 0's 'image' must be a PIL.Image.Image, got bytes"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": b"png"}]}], GREEDY)
    template = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}"
                                   "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    try:
        with pytest.raises(ImageCountError, match=r"placed 0 image markers \('<start_of_image>'\) for 1 image"):
            llm.chat(conversation(picture(10, 10, seed=1)), GREEDY)
    finally:
        llm.tokenizer.chat_template = template
    text_only = LLM(str(write_text_only(folder, tmp_path)), device="cpu",
                    engine_config=EngineConfig(num_kv_blocks=16, max_num_batched_tokens=256))
    with pytest.raises(ValueError, match="does not take images: it has no vision encoder loaded"):
        text_only.chat(conversation(picture(10, 10, seed=1)), GREEDY)
    assert llm.engine.is_idle_and_clean() and text_only.engine.is_idle_and_clean()


def write_text_only(folder, tmp_path):
    """The folder with a config.json that has no vision_config (the loader serves it as text)."""
    import json
    import shutil

    target = tmp_path / "text"
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config.pop("vision_config")
    (target / "config.json").write_text(json.dumps(config))
    return target
