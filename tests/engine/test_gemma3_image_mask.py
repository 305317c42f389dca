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
    params,
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
    outputs = run(engine, work, vision, max_tokens=16)
    assert engine.scheduler.preemption.num_preemptions_by_mode[mode] > 0
    for output, item in zip(outputs, work):
        assert_matches(output, reference(hf_model, item, 16))


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


ENDING = prompt([60 + i for i in range(10)], 5)  # ends with <end_of_image>: 29 tokens, the image [12, 28)
LAST = prompt([60 + i for i in range(7)], 5)
LAST.token_ids.pop()  # no <end_of_image>: the image [9, 25) ends the prompt


@pytest.mark.parametrize("item, cached", [(ENDING, 24), (LAST, 24)], ids=["image-then-eoi", "image-last"])
def test_an_image_ending_the_prompt_after_a_hit(gemma3_image, item, cached):
    """The same prompt again hits up to inside its last image (blocks of 8: [0, 24)); its first chunk takes the
    image's rest, or, where the image ends the prompt, its last token alone runs as a decode row."""
    model, vision, hf_model = gemma3_image
    engine = make_engine(model, budget=MM, block_size=8)
    expected = reference(hf_model, item)
    [first] = run(engine, [item], vision)
    [second] = run(engine, [item], vision)
    assert second.num_cached_tokens == cached
    assert_matches(first, expected)
    assert_matches(second, expected)


@pytest.mark.parametrize("spec_type", ["ngram", "draft"])
def test_speculative_decoding_over_images(gemma3_image, spec_type):
    """Drafts verified over image prompts (the draft model, the target's text model itself, sees the soft
    tokens as text, causally: its drafts may miss, never wrongly kept) give transformers' tokens."""
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from tests.helpers.spec_costs import FixedStepCost

    model, vision, hf_model = gemma3_image
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=MM + 4,
                                                    spec_type=spec_type, check_integrity=True),
                          draft_model=model if spec_type == "draft" else None)
    engine.scheduler.speculation.cost = FixedStepCost()
    work = [ONE, TWO, ENDING]
    outputs = run(engine, work, vision, max_tokens=16)
    for output, item in zip(outputs, work):
        assert_matches(output, reference(hf_model, item, 16))
    assert engine.stats().counters.spec_num_draft_tokens > 0


@pytest.mark.gpu
def test_the_triton_backend_on_cuda_equals_transformers(gemma3_image, tmp_path):
    """The same through the Triton kernels (KEY_LIMITS compiled in for the image chunks), batched and with a
    budget that would cut the images; float32 on the GPU (no TF32 in the kernels' fp32 products)."""
    _, _, hf_model = gemma3_image
    folder = tmp_path / "model"
    write_gemma3_image_model(folder, MM)
    model = load_model(folder, dtype=torch.float32, device="cuda").model
    vision = load_gemma_vision(folder, device="cuda")
    for budget in (64, MM + 1):
        engine = make_engine(model, budget=budget, attention_backend="triton")
        assert engine.runner.backend.name == "triton"
        work = [TEXT, ONE, ANOTHER, TWO]
        outputs = run(engine, work, CudaPixels(vision))
        for output, item in zip(outputs, work):
            assert_matches(output, reference(hf_model, item), atol=1e-3)


class CudaPixels:
    """GemmaVision on CUDA handed the CPU pixel values the prompts hold."""

    def __init__(self, vision) -> None:
        self.vision = vision

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision.encode(pixel_values.cuda())


def test_the_rest_of_an_image_after_a_hit_may_pass_the_budget_beside_decodes(gemma3_image):
    """Ten streams decoding leave 6 of a 16-token budget; a request whose hit ends inside its image (16 of
    [7, 23)) takes the image's rest (7 tokens) whole as the step's first prefill chunk, past the budget (the
    streams never stall it), and gives transformers' tokens; every step passes the scheduling checks."""
    from tests.helpers.engine_checks import StepChecker

    model, vision, hf_model = gemma3_image
    engine = make_engine(model, budget=MM)
    checker = StepChecker(engine)  # from the start: it keeps its own model of the pool's blocks
    engine.add_request(ONE.token_ids, params(), multimodal=ONE.multimodal(vision))
    while engine.has_unfinished_requests():
        engine.step()
        checker.after_step()
    streams = [engine.add_request([2, 100 + i, 101 + i], params(30)) for i in range(10)]
    while any(engine.requests[r].seqs[0].num_computed_tokens < 3 for r in streams):
        engine.step()
        checker.after_step()
    other = prompt([5, 6, 7, 8, 9], 1, [50, 51])
    request_id = engine.add_request(other.token_ids, params(), multimodal=other.multimodal(vision))
    sizes, final = [], {}
    while engine.has_unfinished_requests():
        final.update((output.request_id, output) for output in engine.step() if output.finished)
        sizes.append(checker.batch.num_tokens)
        checker.after_step()
    assert engine.is_idle_and_clean()
    assert final[request_id].num_cached_tokens == 16 and max(sizes) == MM + 1  # 10 decodes + 7
    assert_matches(final[request_id], reference(hf_model, other))


def test_a_window_shorter_than_the_image_still_equals_transformers(tmp_path):
    """transformers' sliding layers keep AND(window, OR(causal, same image)): a key more than W - 1 before its
    query stays hidden inside an image too, as the window's lower bound (each query's own position - W + 1)
    does here. So the key limits alone give its mask whatever the window (a window of 8, images of 16)."""
    hf_model = write_gemma3_image_model(tmp_path, MM, window=8).eval()
    model, vision = load_model(tmp_path, dtype=torch.float32).model, load_gemma_vision(tmp_path)
    for budget in (64, MM + 1):
        outputs = run(make_engine(model, budget=budget), [ONE, TWO], vision)
        for output, item in zip(outputs, [ONE, TWO]):
            assert_matches(output, reference(hf_model, item))


def test_without_chunked_prefill_an_image_longer_than_the_budget_runs(gemma3_image, expected):
    """Without chunked prefill a prompt runs whole (alone among a step's prefills it may pass the budget), so a
    span longer than the budget is not refused there."""
    model, vision, _ = gemma3_image
    outputs = run(make_engine(model, budget=8, enable_chunked_prefill=False), [ONE, TWO], vision)
    assert_matches(outputs[0], expected["one"])
    assert_matches(outputs[1], expected["two"])
