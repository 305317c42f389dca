"""Gemma 3's bidirectional image mask through the engine: a tiny random Gemma3ForConditionalGeneration, its
language model loaded by localserve and its images encoded by our GemmaVision, gives transformers' greedy
tokens and log-probabilities (pixel values and token_type_ids) alone, batched, with chunk budgets that would
cut an image, through preemption by recompute and by swap, on a prefix hit inside an image, with two images;
and without the mask (bidirectional off) it does not."""

from __future__ import annotations

import pytest
import torch

from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from localserve.loading.vision import load_gemma_vision
from tests.helpers.gemma_image_engine import (
    ImagePrompt,
    assert_matches,
    make_engine,
    reference,
    run,
    write_gemma3_image_model,
)

MM = 16  # soft tokens an image: the window's length


@pytest.fixture(scope="module")
def gemma3_image(tmp_path_factory):
    """(our text model, our vision encoder, transformers' model), float32."""
    folder = tmp_path_factory.mktemp("gemma3_image")
    hf_model = write_gemma3_image_model(folder, MM).eval()
    return load_model(folder, dtype=torch.float32).model, load_gemma_vision(folder), hf_model


def prompt(*parts) -> ImagePrompt:
    return ImagePrompt.of(list(parts), MM)


ONE = prompt([5, 6, 7, 8, 9], 1, [10, 11, 12])  # the image's tokens [7, 23): across the first block's end
TWO = prompt([20, 21], 2, [22, 23, 24], 3, [25, 26])  # two images, blocks apart
TEXT = prompt([30 + i for i in range(25)])
ANOTHER = prompt([40, 41, 42, 43], 4, [44])


@pytest.fixture(scope="module")
def expected(gemma3_image):
    _, _, hf_model = gemma3_image
    return {name: reference(hf_model, item) for name, item in
            {"one": ONE, "two": TWO, "text": TEXT, "another": ANOTHER}.items()}


def test_our_encoder_gives_transformers_image_features(gemma3_image):
    _, vision, hf_model = gemma3_image
    images = torch.stack(ONE.images + TWO.images)
    with torch.no_grad():
        theirs = hf_model.get_image_features(images, return_dict=True).pooler_output
        torch.testing.assert_close(vision.encode(images), theirs.reshape(vision.encode(images).shape))


@pytest.mark.parametrize("name, item", [("one", ONE), ("two", TWO)])
def test_alone_equals_transformers(gemma3_image, expected, name, item):
    model, vision, _ = gemma3_image
    [output] = run(make_engine(model), [item], vision)
    assert_matches(output, expected[name])


def test_without_the_mask_the_logits_differ(gemma3_image, expected):
    """The mask matters: the same spans computed causally give other log-probabilities (else the tests here
    prove nothing)."""
    model, vision, _ = gemma3_image
    [output] = run(make_engine(model), [ONE], vision, bidirectional=False)
    with pytest.raises(AssertionError):
        assert_matches(output, expected["one"])


@pytest.mark.parametrize("budget", [MM, MM + 1, 20, 24, 30])
def test_chunk_budgets_that_would_cut_an_image(gemma3_image, expected, budget):
    """Budgets that would end a chunk inside an image: the chunk ends at its start, and the image is computed
    in one step (a budget of exactly its length included)."""
    model, vision, _ = gemma3_image
    engine = make_engine(model, budget=budget)
    calls: list = []
    outputs = run(engine, [ONE, TWO], vision, calls=calls)
    assert_matches(outputs[0], expected["one"])
    assert_matches(outputs[1], expected["two"])
    assert sorted(calls) == [0, 0, 1]  # each image encoded once


def test_a_span_longer_than_the_budget_is_refused(gemma3_image):
    model, vision, _ = gemma3_image
    engine = make_engine(model, budget=MM - 1)
    with pytest.raises(ValueError, match=r"image span 0 \(tokens \[7, 23\)\) is bidirectional and 16 tokens long, "
                                         r"more than a step's 15 tokens"):
        engine.add_request(ONE.token_ids, SamplingParams(max_tokens=2), multimodal=ONE.multimodal(vision))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("budget", [64, MM + 1])
def test_batched_with_other_requests_equals_alone(gemma3_image, expected, budget):
    model, vision, _ = gemma3_image
    outputs = run(make_engine(model, budget=budget), [TEXT, ONE, ANOTHER, TWO], vision)
    for output, name in zip(outputs, ["text", "one", "another", "two"]):
        assert_matches(output, expected[name])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_images(gemma3_image, mode):
    """A small pool: longer outputs outgrow it and requests are preempted; each gives transformers' tokens."""
    model, vision, hf_model = gemma3_image
    engine = make_engine(model, budget=32, num_blocks=9, mode=mode, block_size=8)
    work = [ONE, ANOTHER, TWO]
    outputs = run(engine, work, vision, max_tokens=24)
    assert engine.scheduler.preemption.num_preemptions_by_mode[mode] > 0
    for output, item in zip(outputs, work):
        assert_matches(output, reference(hf_model, item, 24))


def test_a_prefix_hit_inside_an_image(gemma3_image):
    """A second request with the same text and image, then other text: its hit covers the first block, which
    ends inside the image; its first chunk starts there and takes the rest of the image."""
    model, vision, hf_model = gemma3_image
    engine = make_engine(model, budget=64)
    run(engine, [ONE], vision)
    other = prompt([5, 6, 7, 8, 9], 1, [50, 51, 52, 53])
    [output] = run(engine, [other], vision)
    assert output.num_cached_tokens == 16  # the first block: the image is [7, 23)
    assert_matches(output, reference(hf_model, other))
