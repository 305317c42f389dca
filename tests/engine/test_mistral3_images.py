"""Mistral Small 3.x's images through the engine: a tiny Mistral3ForConditionalGeneration folder loaded as the
server loads it (the text model by loading/hf.py, the encoder by the registered loader), a chat rendered by
the real Mistral Small 3.2 template with image parts, each `[IMG]` marker replaced by the encoder's text, the
span found in the ids; the engine's greedy tokens and first log-probabilities equal transformers'
`generate(input_ids, pixel_values, image_sizes)` on the same folder: one image, two of different sizes in one
prompt, a batch, and under preemption by recompute and by swap."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.multimodal import ImageSpan, MultiModalInputs
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from localserve.loading.image_encoders import load_image_encoder
from localserve.tokenizer.tokenizer import Tokenizer
from tests.helpers.pictures import picture, reencoded
from tests.helpers.pixtral_models import IMG_END, reference_image_processor, write_tiny_mistral3

NUM_TOKENS = 8
LONG = 40  # tokens made under preemption: a pressed pool outgrows its blocks
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    """(encoder, our language model, tokenizer, transformers' model that never stops at its eos)."""
    folder = tmp_path_factory.mktemp("mistral3_engine")
    hf_model = write_tiny_mistral3(folder, seed=7)
    hf_model.generation_config.eos_token_id = None
    config = json.loads((folder / "config.json").read_text())
    encoder = load_image_encoder(folder, config, torch.float32, "cpu")
    assert encoder is not None
    model = load_model(folder, dtype=torch.float32).model
    return encoder, model, Tokenizer.from_hf_folder(folder), hf_model


class ImageRequest:
    """A chat with pictures made into what the engine takes (as the server does) and what transformers takes."""

    def __init__(self, encoder, tokenizer: Tokenizer, text: str, pictures: list) -> None:
        content = [{"type": "text", "text": text}] + [{"type": "image"} for _ in pictures]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
        rendered = tokenizer.apply_chat_template(messages)
        prepared = [encoder.prepare(image) for image in pictures]
        pieces = rendered.split(encoder.marker)
        assert len(pieces) == len(pictures) + 1  # the template wrote one marker per image
        expanded = pieces[0] + "".join(one.text + piece for one, piece in zip(prepared, pieces[1:]))
        self.ids = tokenizer.encode(expanded, add_special_tokens=False)
        spans, start = [], 0
        for index, one in enumerate(prepared):
            offset = next(i for i in range(start, len(self.ids)) if tuple(self.ids[i:i + len(one.span_ids)]) ==
                          one.span_ids)
            assert self.ids[offset + len(one.span_ids)] == IMG_END
            digest = hashlib.sha256(pictures[index].tobytes()).digest()
            spans.append(ImageSpan(offset, len(one.span_ids), digest))
            start = offset + len(one.span_ids)
        self.spans, self.prepared, self.pictures, self.encoder = tuple(spans), prepared, pictures, encoder

    def multimodal(self) -> MultiModalInputs:
        return MultiModalInputs(self.spans, lambda index: self.encoder.encode(self.prepared[index]))

    def reference(self, hf_model, num_tokens: int = NUM_TOKENS) -> tuple[list[int], torch.Tensor]:
        """transformers' greedy tokens and first log-probabilities."""
        batch = reference_image_processor()(images=self.pictures, return_tensors="pt")
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([self.ids]), pixel_values=batch["pixel_values"],
                                    image_sizes=batch["image_sizes"], max_new_tokens=num_tokens, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
        return out.sequences[0, len(self.ids):].tolist(), torch.log_softmax(out.logits[0][0].float(), dim=-1)


def make_engine(model, budget: int = 256, num_blocks: int = 256, mode: str = "recompute"):
    return build_engine(model, None, EngineConfig(
        num_kv_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=budget, enable_prefix_caching=True,
        preemption_mode=mode, check_integrity=True))


def run_requests(engine, requests: list[ImageRequest], num_tokens: int = NUM_TOKENS) -> list:
    """Each request's final RequestOutput (greedy, 5 top log-probs); the engine ends idle with every block back."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=5)
    ids = [engine.add_request(request.ids, params, multimodal=request.multimodal()) for request in requests]
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    return [final[request_id] for request_id in ids]


def run(engine, requests: list[ImageRequest], num_tokens: int = NUM_TOKENS) -> list:
    """Each request's completion."""
    return [output.outputs[0] for output in run_requests(engine, requests, num_tokens)]


def assert_first_logprobs(output, expected: torch.Tensor) -> None:
    assert output.top_logprobs[0], "no top log-probabilities"
    for token, logprob in output.top_logprobs[0]:
        assert abs(logprob - float(expected[token])) < LOGPROB_TOLERANCE, (token, logprob, float(expected[token]))
    assert [token for token, _ in output.top_logprobs[0]][0] == int(expected.argmax())


def pictures() -> list:
    """53 x 37 (5 x 6 tokens), 70 x 20 (2 x 6), 30 x 30 (4 x 4), 9 x 40 (5 x 2): rows x columns."""
    return [reencoded(picture(53, 37, seed=1), "PNG"), reencoded(picture(70, 20, seed=2), "JPEG"),
            picture(30, 30, seed=3, mode="RGBA"), picture(9, 40, seed=4, mode="L")]


@pytest.fixture(scope="module")
def requests(mistral3):
    encoder, _, tokenizer, _ = mistral3
    first, second, third, fourth = pictures()
    return [ImageRequest(encoder, tokenizer, "What is this?", [first]),
            ImageRequest(encoder, tokenizer, "Compare them.", [second, third]),  # two sizes in one prompt
            ImageRequest(encoder, tokenizer, "Tell", [fourth]),
            ImageRequest(encoder, tokenizer, "Again:", [third])]


@pytest.fixture(scope="module")
def references(mistral3, requests):
    """transformers' LONG greedy tokens and first log-probabilities of each request (shorter runs: a prefix)."""
    return [request.reference(mistral3[3], LONG) for request in requests]


@pytest.mark.parametrize("index", [0, 1])
def test_alone_equals_transformers_generate(mistral3, requests, references, index):
    """One image (5 x 6 tokens); two images of different sizes in one prompt (2 x 6 and 4 x 4 tokens)."""
    _, model, _, _ = mistral3
    request = requests[index]
    assert [span.length for span in request.spans] == ([5 * 7 - 1] if index == 0 else [2 * 7 - 1, 4 * 5 - 1])
    [output] = run(make_engine(model), [request])
    tokens, logprobs = references[index]
    assert list(output.token_ids) == tokens[:NUM_TOKENS]
    assert_first_logprobs(output, logprobs)


def test_the_image_matters(mistral3, requests, references):
    """The same ids with the break token's embedding in every row of the span give other tokens (else the
    tests here could pass with the images ignored)."""
    _, model, _, _ = mistral3
    request = requests[0]
    engine = make_engine(model)
    blind = MultiModalInputs(request.spans, lambda index: request.encoder.break_embedding.expand(
        request.spans[index].length, -1).clone())
    request_id = engine.add_request(request.ids, SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                                ignore_eos=True), multimodal=blind)
    assert list(engine.run_to_completion()[request_id].outputs[0].token_ids) != references[0][0][:NUM_TOKENS]


@pytest.mark.parametrize("budget, num_blocks, mode", [(256, 256, "recompute"), (24, 256, "recompute"),
                                                      (16, 8, "recompute"), (16, 8, "swap")])
def test_a_batch_equals_transformers_whatever_the_chunks_and_preemption(mistral3, requests, references, budget,
                                                                         num_blocks, mode):
    """All four requests at once; chunks of 24 tokens cut the images; a pool of 8 blocks of 16 tokens holds
    less than the work, so requests are preempted and come back (recomputed, or swapped out and in)."""
    _, model, _, _ = mistral3
    engine = make_engine(model, budget=budget, num_blocks=num_blocks, mode=mode)
    pressed = num_blocks < 100
    num_tokens = LONG if pressed else NUM_TOKENS
    outputs = run(engine, requests, num_tokens)
    if pressed:
        assert engine.scheduler.preemption.num_preemptions_by_mode[mode] > 0
    for output, (tokens, logprobs) in zip(outputs, references):
        assert list(output.token_ids) == tokens[:num_tokens]
        assert_first_logprobs(output, logprobs)


def test_a_hf_model_copy_in_float64_agrees(mistral3, requests, references):
    """The references are not a float32 accident: transformers in float64 gives the same greedy tokens."""
    hf64 = copy.deepcopy(mistral3[3]).to(torch.float64)
    request = requests[1]
    batch = reference_image_processor()(images=request.pictures, return_tensors="pt")
    with torch.no_grad():
        out = hf64.generate(torch.tensor([request.ids]), pixel_values=batch["pixel_values"].double(),
                            image_sizes=batch["image_sizes"], max_new_tokens=NUM_TOKENS, do_sample=False)
    assert out[0, len(request.ids):].tolist() == references[1][0][:NUM_TOKENS]


def test_the_same_picture_hits_the_prefix_cache_and_another_of_its_size_does_not(mistral3, requests, references):
    """The request again: every full block of its prompt is cached (image rows and break rows alike) and the
    answer is transformers'; a picture of the same size with one pixel changed hits only the text blocks before
    its span."""
    encoder, model, tokenizer, _ = mistral3
    engine = make_engine(model)
    request = requests[0]
    run(engine, [request])
    [again] = run_requests(engine, [request])
    assert again.num_cached_tokens == (len(request.ids) - 1) // 16 * 16  # the last prompt token is computed
    assert list(again.outputs[0].token_ids) == references[0][0][:NUM_TOKENS]
    changed = request.pictures[0].convert("RGB")
    changed.putpixel((10, 10), tuple(255 - value for value in changed.getpixel((10, 10))))
    other = ImageRequest(encoder, tokenizer, "What is this?", [changed])
    assert other.ids == request.ids and other.spans[0].content_hash != request.spans[0].content_hash
    [output] = run_requests(engine, [other])
    assert output.num_cached_tokens == request.spans[0].offset // 16 * 16
    assert list(output.outputs[0].token_ids) == list(run(make_engine(model), [other])[0].token_ids)
