"""Qwen3.5 and Qwen3.5-MoE see images through the engine (tests/helpers/qwen_vision_models.py: tiny random
Qwen3_5(Moe)ForConditionalGeneration folders): our encoder's embeddings equal transformers' image features,
and greedy tokens and log-probabilities equal transformers' generate with pixel_values and image_grid_thw
(its mRoPE positions) for prompts with one or two images of different sizes: alone, batched, in chunks that
split an image, under preemption by recompute and by swap, after a prefix hit on an image (resumed from
the linear layers' state checkpoints), and with speculative decoding. Every step checked, every block and
state slot back."""

from __future__ import annotations

import json

import pytest
import torch
from localserve.models.vision.qwen3_5_encoder import QwenImageEncoder

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.multimodal import MultiModalInputs
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from localserve.loading.image_encoders import load_image_encoder
from tests.helpers.engine_checks import StepChecker
from tests.helpers.oracle_drafter import OracleDrafter
from tests.helpers.pictures import picture, reencoded
from tests.helpers.qwen_vision_models import (
    IDS,
    image_prompt,
    reference_processor,
    transformers_greedy,
    write_tiny_qwen3_5_vision,
)
from tests.helpers.spec_costs import FixedStepCost

CHECKPOINT = 32  # tokens between the linear layers' state checkpoints: two blocks
LOGPROB_TOLERANCE = 1e-4
# 53 x 37 -> a 10 x 14 patch grid: 35 tokens (5 x 7 merged); 70 x 20 -> 4 x 18: 18 tokens (2 x 9)
BIG, WIDE = reencoded(picture(53, 37, seed=1), "PNG"), reencoded(picture(70, 20, seed=2), "JPEG")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = write_tiny_qwen3_5_vision(folder, moe=request.param == "qwen3_5_moe")
    config = json.loads((folder / "config.json").read_text())
    encoder = load_image_encoder(folder, config, torch.float32, "cpu")
    return hf_model, load_model(folder, dtype=torch.float32).model, encoder


def layouts(encoder) -> list[tuple]:
    """Prompts: an image between text; two images of different sizes; an image first; text only."""
    return [image_prompt([[5, 6, 7], BIG, [8, 9, 10, 11]], encoder),
            image_prompt([[12], WIDE, [13, 14, 15], BIG, [16, 17]], encoder),
            image_prompt([BIG, [18, 19, 20, 21, 22, 23]], encoder),
            image_prompt([[24 + i for i in range(30)]], encoder)]


def run(model, work, max_tokens: int = 6, build=build_engine, **config) -> tuple[list, object]:
    """Each (ids, multimodal) request's final output from an engine of `config` (made by `build`), every
    step checked; the engine ends idle with every block and state slot back."""
    config = {"num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64,
              "state_checkpoint_tokens": CHECKPOINT, "check_integrity": True} | config
    engine = build(model, None, EngineConfig(**config))
    checker = StepChecker(engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(prompt, params, multimodal=multimodal) for prompt, multimodal, _ in work]
    final = {}
    while engine.has_unfinished_requests():
        final.update((output.request_id, output) for output in engine.step() if output.finished)
        checker.after_step()
    assert engine.is_idle_and_clean()
    return [final[request_id].outputs[0] for request_id in ids], engine


def assert_equals_transformers(hf_model, item, output) -> None:
    prompt, _, pictures = item
    tokens, logprobs = transformers_greedy(hf_model, prompt, pictures, len(output.token_ids))
    assert list(output.token_ids) == tokens
    for step, (token, ours) in enumerate(zip(tokens, output.logprobs)):
        assert abs(ours - logprobs[step][token].item()) <= LOGPROB_TOLERANCE, step


@pytest.fixture(scope="module")
def alone(models):
    return [run(models[1], [item], max_num_seqs=1, enable_prefix_caching=False)[0][0] for item in layouts(models[2])]


def test_the_encoder_gives_transformers_image_features_and_processor_expansion(models):
    hf_model, _, encoder = models
    assert isinstance(encoder, QwenImageEncoder) and encoder.marker == "<|image_pad|>" and encoder.hidden_size == 64
    processed = reference_processor()(images=[BIG, WIDE], return_tensors="pt")
    with torch.no_grad():
        expected = hf_model.model.get_image_features(processed["pixel_values"], processed["image_grid_thw"])
    for picture_, grid, features in zip((BIG, WIDE), processed["image_grid_thw"], expected.pooler_output):
        prepared = encoder.prepare(picture_)
        tokens = int(grid.prod()) // 4  # Qwen3VLProcessor: one image pad per merged token
        assert prepared.text == "<|image_pad|>" * tokens and prepared.span_ids == (IDS["image_token_id"],) * tokens
        assert torch.equal(prepared.inputs[1], grid[None])
        embeddings = encoder.encode(prepared)
        assert (embeddings - features).abs().max() <= 1e-5 * features.abs().max()


def test_alone_gives_transformers_greedy_tokens_and_logprobs(models, alone):
    for item, output in zip(layouts(models[2]), alone):
        assert_equals_transformers(models[0], item, output)


def test_the_positions_matter(models, alone):
    """The same embeddings at plain positions give other log-probabilities (else the above proves little)."""
    prompt, multimodal, _ = layouts(models[2])[1]
    plain = MultiModalInputs(multimodal.spans, multimodal.embeddings)
    [output], _ = run(models[1], [(prompt, plain, [])], max_num_seqs=1, enable_prefix_caching=False)
    assert max(abs(a - b) for a, b in zip(output.logprobs, alone[1].logprobs)) > 1e-3


@pytest.mark.parametrize("budget, num_blocks, mode", [(13, 64, "recompute"), (16, 9, "recompute"), (16, 9, "swap")])
def test_batched_in_chunks_splitting_images_and_under_preemption_equals_alone(models, alone, budget, num_blocks,
                                                                              mode):
    """Chunks of 13 tokens cut every image; a pool of 9 blocks preempts (long outputs outgrow it)."""
    work = layouts(models[2])
    pressed = num_blocks < 64
    outputs, engine = run(models[1], work, max_tokens=30 if pressed else 6, max_num_batched_tokens=budget,
                          num_kv_blocks=num_blocks, num_cpu_blocks=64, preemption_mode=mode)
    assert max(step.num_seqs for step in engine.step_history) > 1
    if pressed:
        assert engine.scheduler.preemption.num_preemptions_by_mode[mode] > 0
        expected = [run(models[1], [item], max_tokens=30, max_num_seqs=1)[0][0] for item in work]
    else:
        expected = alone
    for output, want in zip(outputs, expected):
        assert list(output.token_ids) == list(want.token_ids)
        assert max(abs(a - b) for a, b in zip(output.logprobs, want.logprobs)) <= LOGPROB_TOLERANCE


def test_a_prefix_hit_after_an_image_resumes_from_a_checkpoint(models):
    """A second request with the same image and text up to 70 tokens hits the blocks and the state saved after
    64 (the last checkpoint of the shared part, past the image) and gives transformers' tokens; one with
    another picture of the same size misses from the image's block on."""
    hf_model, model, encoder = models
    first = image_prompt([[5, 6, 7, 8, 9], BIG, [30 + i for i in range(40)]], encoder)
    second = image_prompt([[5, 6, 7, 8, 9], BIG, [30 + i for i in range(28)] + [90, 91, 92]], encoder)
    other = image_prompt([[5, 6, 7, 8, 9], reencoded(picture(53, 37, seed=3), "PNG"), [30 + i for i in range(28)]],
                         encoder)
    assert len(first[0]) == 82 and second[0][:70] == first[0][:70] and other[0] == second[0][:70]
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=64,
                                                    state_checkpoint_tokens=CHECKPOINT, check_integrity=True))
    outputs = []
    for prompt, multimodal, _ in (first, second, other):  # one after the other
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
        request_id = engine.add_request(prompt, params, multimodal=multimodal)
        outputs.append(engine.run_to_completion()[request_id])
    assert engine.is_idle_and_clean()
    assert [output.num_cached_tokens for output in outputs] == [0, 64, 0]  # the image starts in block 0
    assert_equals_transformers(hf_model, second, outputs[1].outputs[0])
    assert_equals_transformers(hf_model, other, outputs[2].outputs[0])



def test_verified_drafts_after_images_keep_greedy_tokens(models):
    """Speculative decoding after images: verify rows carry the request's mRoPE positions (text after an image
    shifted by its delta) and are held over the linear layers; with drafts kept whole, cut and rejected
    (oracle drafts with planted wrong tokens), tokens and logprobs equal those without speculation."""
    work = layouts(models[2])
    expected = [run(models[1], [item], max_tokens=20, max_num_seqs=1)[0][0] for item in work]
    oracle = OracleDrafter([prompt + list(out.token_ids) for (prompt, _, _), out in zip(work, expected)],
                           models[1].config.vocab_size, seed=4)

    def speculating(model, tokenizer, config):
        engine = build_engine(model, tokenizer, config)
        engine.scheduler.speculation.drafter = oracle
        engine.scheduler.speculation.cost = FixedStepCost()
        return engine

    outputs, engine = run(models[1], work, max_tokens=20, build=speculating, spec_type="ngram", spec_tokens=4)
    totals = engine.scheduler.speculation.totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    for output, want in zip(outputs, expected):
        assert list(output.token_ids) == list(want.token_ids)
        assert max(abs(a - b) for a, b in zip(output.logprobs, want.logprobs)) <= LOGPROB_TOLERANCE
