"""Image inputs through the engine (engine/multimodal.py) with a stand-in encoder: greedy tokens equal
transformers' forward given the same input embeddings, whatever the chunking, batching or preemption; the
prefix cache hits for the same pixels only; bad spans are refused naming the span."""

from __future__ import annotations

import copy
import hashlib
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.engine import LLMEngine
from localserve.engine.multimodal import (
    EmbeddingCache,
    ImageSpan,
    MultiModalInputs,
    block_extra_keys,
)
from localserve.engine.sampling_params import SamplingParams
from localserve.kv.block_hash import block_extra_key, block_payload

PLACEHOLDER = 7  # the placeholder token id every image span repeats
HIDDEN = 64  # the tiny Llama's hidden size


class StandInEncoder:
    """Deterministic image embeddings from an image's bytes ([num_tokens, HIDDEN], float64), counting calls:
    what a vision tower plus projector hands the engine."""

    def __init__(self) -> None:
        self.num_calls = 0

    def embed(self, image: bytes, num_tokens: int) -> torch.Tensor:
        self.num_calls += 1
        seed = int.from_bytes(hashlib.sha256(image).digest()[:8], "little")
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(num_tokens, HIDDEN, generator=generator, dtype=torch.float64)

    def inputs(self, prompt_spans: list[tuple[int, int, bytes]]) -> MultiModalInputs:
        """MultiModalInputs of (offset, length, image bytes) spans, embeddings made on first use."""
        spans = tuple(ImageSpan(offset, length, hashlib.sha256(image).digest())
                      for offset, length, image in prompt_spans)
        return MultiModalInputs(spans, lambda index: self.embed(prompt_spans[index][2], prompt_spans[index][1]))


def image_prompt(parts: list[list[int] | tuple[int, bytes]]) -> tuple[list[int], list[tuple[int, int, bytes]]]:
    """A prompt of text parts (token lists) and images ((num_tokens, bytes)): its ids with placeholders and its
    (offset, length, bytes) spans."""
    tokens: list[int] = []
    spans = []
    for part in parts:
        if isinstance(part, tuple):
            spans.append((len(tokens), part[0], part[1]))
            tokens += [PLACEHOLDER] * part[0]
        else:
            tokens += part
    return tokens, spans


def make_engine(model, budget=64, prefix=True, num_blocks=256, mode="recompute", max_num_seqs=16) -> LLMEngine:
    return build_engine(model, None, EngineConfig(
        num_kv_blocks=num_blocks, max_num_seqs=min(max_num_seqs, budget), max_num_batched_tokens=budget,
        enable_prefix_caching=prefix, preemption_mode=mode, check_integrity=True))


def run(engine: LLMEngine, work, encoder: StandInEncoder, max_tokens=6) -> list:
    """Each (tokens, spans) request's final output; the engine ends idle with every block back."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(tokens, params, multimodal=encoder.inputs(spans) if spans else None)
           for tokens, spans in work]
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    return [final[request_id] for request_id in ids]


def greedy_reference(hf_model, tokens: list[int], spans, encoder: StandInEncoder, num_tokens: int) -> list[int]:
    """transformers' greedy tokens from `inputs_embeds`: the token embeddings with each span's rows replaced."""
    ids = list(tokens)
    images = [(offset, encoder.embed(image, length)) for offset, length, image in spans]
    out = []
    with torch.no_grad():
        for _ in range(num_tokens):
            embeds = hf_model.model.embed_tokens(torch.tensor([ids]))
            for offset, rows in images:
                embeds[0, offset:offset + len(rows)] = rows
            logits = hf_model(inputs_embeds=embeds).logits[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.fixture(scope="module")
def hf64(tiny_model_dir):
    _, hf_model = tiny_model_dir("llama")
    return copy.deepcopy(hf_model).to(torch.float64).eval()


CAT, DOG = bytes(range(48)), bytes(range(48, 96))
# Spans crossing block boundaries (16 tokens a block), one ending the prompt's second block exactly.
LAYOUT = [[3, 5, 9], (20, CAT), [11, 12, 13, 14, 15, 16, 17], (10, DOG), [40, 41]]


@pytest.mark.parametrize("budget", [64, 5, 13])
def test_greedy_tokens_with_images_equal_transformers_given_the_same_embeddings(tiny64, hf64, budget):
    encoder = StandInEncoder()
    tokens, spans = image_prompt(LAYOUT)
    [output] = run(make_engine(tiny64, budget=budget), [(tokens, spans)], encoder)
    assert list(output.token_ids) == greedy_reference(hf64, tokens, spans, StandInEncoder(), 6)
    assert encoder.num_calls == 2  # each image once, however many chunks cut it


def test_placeholders_without_their_image_give_other_tokens(tiny64):
    """The images matter: the same ids run as text give other tokens (else the tests above prove nothing)."""
    tokens, spans = image_prompt(LAYOUT)
    with_images, text_only = run(make_engine(tiny64), [(tokens, spans), (tokens, [])], StandInEncoder())
    assert list(with_images.token_ids) != list(text_only.token_ids)


WORK = [
    image_prompt(LAYOUT),
    image_prompt([[4, 4], (30, DOG), [9]]),
    image_prompt([(17, CAT), [5, 6, 7, 8]]),
    image_prompt([[10 + i for i in range(40)]]),  # text only
    image_prompt([[1, 2], (12, bytes(range(200, 230))), [3], (12, DOG), [8, 9, 10]]),
]


@pytest.fixture(scope="module")
def alone(tiny64):
    return [list(run(make_engine(tiny64, prefix=False), [item], StandInEncoder())[0].token_ids) for item in WORK]


@pytest.mark.parametrize("budget, num_blocks, mode", [(64, 256, "recompute"), (7, 256, "recompute"),
                                                      (16, 10, "recompute"), (16, 10, "swap")])
def test_a_batch_with_images_equals_each_request_alone(tiny64, alone, budget, num_blocks, mode):
    engine = make_engine(tiny64, budget=budget, num_blocks=num_blocks, mode=mode)
    pressed = num_blocks < 100  # the pool holds a fraction of the work: longer outputs outgrow it
    outputs = run(engine, WORK, StandInEncoder(), max_tokens=40 if pressed else 6)
    if pressed:
        assert engine.scheduler.preemption.num_preemptions_by_mode[mode] > 0
        expected = [list(run(make_engine(tiny64, prefix=False), [item], StandInEncoder(), max_tokens=40)[0].token_ids)
                    for item in WORK]
    else:
        expected = alone
    assert [list(output.token_ids) for output in outputs] == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("beam_search", [False, True])
def test_samples_and_beams_keep_their_images_through_preemption(tiny64, mode, beam_search):
    """n=3 seeded samples (forks) or 3 beams of an image prompt, pressed by other requests until preempted,
    give what they give alone."""
    tokens, spans = image_prompt([[3, 4], (21, CAT), [5, 6, 7]])
    params = SamplingParams(temperature=0 if beam_search else 1.0, seed=5, n=3, beam_search=beam_search,
                            max_tokens=20, ignore_eos=True)

    def outputs(engine: LLMEngine, others) -> tuple[list[list[int]], str]:
        encoder = StandInEncoder()
        for prompt, prompt_spans in others:  # first: the latest request is the one preempted
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                               multimodal=encoder.inputs(prompt_spans) if prompt_spans else None)
        request_id = engine.add_request(tokens, params, multimodal=encoder.inputs(spans))
        final = engine.run_to_completion()
        assert engine.is_idle_and_clean()
        return [list(completion.token_ids) for completion in final[request_id].outputs], request_id

    pressed = make_engine(tiny64, budget=16, num_blocks=10, mode=mode)
    got, request_id = outputs(pressed, [([10 + i, 11, 12], []) for i in range(3)])  # short prompts, long outputs
    assert got == outputs(make_engine(tiny64, prefix=False), [])[0]
    assert request_id in {preempted for preempted, _ in pressed.scheduler.preemption.recent}


def test_the_same_image_again_hits_the_prefix_cache_and_is_not_encoded_again(tiny64):
    encoder = StandInEncoder()
    engine = make_engine(tiny64)
    first_turn = image_prompt([[3, 4, 5], (24, CAT), [9, 10]])
    [first] = run(engine, [first_turn], encoder)
    # The next turn: the same conversation with the answer and a new question appended.
    tokens, spans = first_turn
    second_turn = (tokens + list(first.token_ids) + [11, 12, 13], spans)
    [second] = run(engine, [second_turn], encoder)
    assert second.num_cached_tokens == 32  # every full block of the first turn's prompt and answer
    # The hit covers the whole image: its embeddings were not even looked up.
    assert encoder.num_calls == 1 and engine.runner.image_embeds.num_hits == 0
    [uncached] = run(make_engine(tiny64, prefix=False), [second_turn], StandInEncoder())
    assert list(second.token_ids) == list(uncached.token_ids)
    # Another request with the same image (its own text after it) hits the blocks before its text.
    [other] = run(engine, [image_prompt([[3, 4, 5], (24, CAT), [77, 78, 79]])], encoder)
    assert other.num_cached_tokens == 16
    # Its image's last 11 tokens are computed again, from the embeddings cache: not encoded again.
    assert encoder.num_calls == 1 and engine.runner.image_embeds.num_hits == 1
    [other_uncached] = run(make_engine(tiny64, prefix=False), [image_prompt([[3, 4, 5], (24, CAT), [77, 78, 79]])],
                           StandInEncoder())
    assert list(other.token_ids) == list(other_uncached.token_ids)


@pytest.mark.parametrize("changed", ["other image", "one pixel"])
def test_another_image_of_the_same_size_never_hits(tiny64, changed):
    engine = make_engine(tiny64)
    encoder = StandInEncoder()
    text = list(range(20, 36))  # a full text block before the image: that one may hit
    run(engine, [image_prompt([text, (24, CAT), [9, 10]])], encoder)
    other = DOG if changed == "other image" else CAT[:17] + bytes([CAT[17] ^ 1]) + CAT[18:]
    tokens, spans = image_prompt([text, (24, other), [9, 10]])
    [output] = run(engine, [(tokens, spans)], encoder)
    assert output.num_cached_tokens == 16  # the text block only
    [uncached] = run(make_engine(tiny64, prefix=False), [(tokens, spans)], StandInEncoder())
    assert list(output.token_ids) == list(uncached.token_ids)


@pytest.mark.parametrize("spans, embeddings, message", [
    ([ImageSpan(8, 4, b"a")], [torch.zeros(4, HIDDEN)], r"image span 0 \(tokens \[8, 12\)\) lies outside the prompt"),
    ([ImageSpan(-1, 2, b"a")], [torch.zeros(2, HIDDEN)], "image span 0 .* lies outside"),
    ([ImageSpan(0, 0, b"a")], [torch.zeros(0, HIDDEN)], "image span 0 .* length must be at least 1"),
    ([ImageSpan(0, 4, b"a"), ImageSpan(3, 2, b"b")], [torch.zeros(4, HIDDEN), torch.zeros(2, HIDDEN)],
     "image span 1 .* overlaps"),
    ([ImageSpan(0, 4, b"a")], [torch.zeros(3, HIDDEN)], r"image span 0 .* shape \(3, 64\), expected \(4, 64\)"),
    ([ImageSpan(0, 4, b"a")], [torch.zeros(4, 32)], r"image span 0 .* expected \(4, 64\)"),
    ([ImageSpan(0, 4, b"")], [torch.zeros(4, HIDDEN)], "image span 0 .* content_hash"),
    ([ImageSpan(0, 4, b"a")], [torch.zeros(4, HIDDEN, dtype=torch.int64)], "image span 0 .* floating-point"),
    ([ImageSpan(0, 4, b"a")], [], "1 image spans but 0 embeddings"),
    ([ImageSpan(0, 4.0, b"a")], [torch.zeros(4, HIDDEN)], "image span 0 .* must be ints"),
])
def test_bad_spans_are_refused_naming_the_span(tiny64, spans, embeddings, message):
    engine = make_engine(tiny64)
    with pytest.raises(ValueError, match=message):
        engine.add_request([PLACEHOLDER] * 10, SamplingParams(max_tokens=2),
                           multimodal=MultiModalInputs(tuple(spans), embeddings))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("embeddings, message", [
    (lambda index: torch.zeros(5, HIDDEN), r"image span 0 \(tokens \[2, 6\)\): embeddings of shape \(5, 64\)"),
    (lambda index: 1 / 0, "image encoder: ZeroDivisionError"),
])
def test_an_encoder_that_fails_fails_its_request_alone(tiny64, alone, embeddings, message):
    engine = make_engine(tiny64, budget=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    encoder = StandInEncoder()
    good = [engine.add_request(tokens, params, multimodal=encoder.inputs(spans) if spans else None)
            for tokens, spans in WORK[:2]]
    bad = engine.add_request([PLACEHOLDER] * 10, params,
                             multimodal=MultiModalInputs((ImageSpan(2, 4, b"a"),), embeddings))
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    assert final[bad].error is not None and re.search(message, final[bad].error)
    assert [list(final[request_id].token_ids) for request_id in good] == alone[:2]


def test_text_only_block_keys_are_unchanged():
    assert block_extra_key(b"", (), 0) == b"" and block_extra_key(b"lora", (b"",), 0) == b"lora"
    assert block_extra_key(b"lora", (), 3) == b"lora"
    assert block_payload(bytes(32), [1, 2], block_extra_key(b"", (b"",), 0)) == block_payload(bytes(32), [1, 2])


def test_block_keys_name_the_image_and_the_place_in_it():
    a, b = b"A" * 32, b"B" * 32
    keys = block_extra_keys([ImageSpan(5, 20, a), ImageSpan(40, 3, b)], 16)
    assert len(keys) == 3 and all(keys)  # blocks 0 and 1 hold image A, block 2 image B
    assert a in keys[0] and a in keys[1] and b in keys[2] and a not in keys[2]
    assert keys[0] != keys[1]  # same image, other place in it
    shifted = block_extra_keys([ImageSpan(6, 20, a), ImageSpan(40, 3, b)], 16)
    assert shifted[0] != keys[0] and shifted[2] == keys[2]
    assert block_extra_keys([ImageSpan(20, 3, a)], 16) == (b"", block_extra_keys([ImageSpan(20, 3, a)], 16)[1])
    assert block_extra_keys([], 16) == ()


def test_the_embeddings_cache_evicts_least_recently_used_by_bytes():
    encoder = StandInEncoder()
    images = [bytes([i]) * 8 for i in range(3)]
    inputs = encoder.inputs([(i * 4, 4, image) for i, image in enumerate(images)])
    row_bytes = HIDDEN * 8  # float64
    cache = EmbeddingCache(max_bytes=8 * row_bytes)  # two images of 4 rows
    get = lambda index: cache.get(inputs, index, HIDDEN, torch.device("cpu"), torch.float64)  # noqa: E731
    assert torch.equal(get(0), StandInEncoder().embed(images[0], 4))
    get(1)
    get(0)  # 0 is now the most recent
    get(2)  # evicts 1
    assert encoder.num_calls == 3 and cache.num_bytes == 8 * row_bytes and len(cache) == 2
    get(0)
    assert encoder.num_calls == 3 and cache.num_hits == 2 and cache.num_encoded == 3
    get(1)
    assert encoder.num_calls == 4  # 1 evicted 2, the least recently used
    assert inputs.spans[2].content_hash not in cache and inputs.spans[0].content_hash in cache
    assert len(EmbeddingCache(max_bytes=row_bytes)) == 0
    small = EmbeddingCache(max_bytes=row_bytes)
    small.get(inputs, 0, HIDDEN, torch.device("cpu"), torch.float64)
    assert len(small) == 0 and small.num_bytes == 0  # too big to keep, still used


@st.composite
def layouts(draw):
    """Prompts of up to 3 images (1-20 tokens, two possible contents each) among text parts, a step budget and
    a preemption mode."""
    parts: list = []
    for _ in range(draw(st.integers(1, 3))):
        parts.append(draw(st.lists(st.integers(10, 255), max_size=9)))
        parts.append((draw(st.integers(1, 20)), draw(st.sampled_from([CAT, DOG]))))
    parts.append(draw(st.lists(st.integers(10, 255), max_size=5)))  # none: an image ends the prompt
    return image_prompt(parts), draw(st.integers(1, 40)), draw(st.sampled_from(["recompute", "swap"]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=layouts(), second=layouts())
def test_span_layouts_and_budgets_give_the_one_pass_tokens_and_every_block_back(tiny64, first, second):
    (prompt_a, budget, mode), (prompt_b, _, _) = first, second
    encoder = StandInEncoder()
    engine = make_engine(tiny64, budget=budget, num_blocks=12, mode=mode)
    # Twice each: the second run of a prompt hits the blocks the first left cached.
    outputs = [list(output.token_ids) for output in run(engine, [prompt_a, prompt_b, prompt_a], encoder, 3)]
    outputs += [list(output.token_ids) for output in run(engine, [prompt_b], encoder, 3)]
    reference = make_engine(tiny64, prefix=False)
    expected = [list(output.token_ids) for output in run(reference, [prompt_a, prompt_b], StandInEncoder(), 3)]
    assert outputs == [expected[0], expected[1], expected[0], expected[1]]
    assert engine.block_manager.num_used_blocks == 0


def test_gemma3_takes_image_embeddings_unscaled_as_transformers_does(tmp_path):
    """Gemma 3 scales token embeddings by sqrt(hidden) and not the image's (transformers' Gemma3Model scatters
    the image features into the scaled embeddings): the engine's tokens equal transformers' forward given
    those input embeddings, over images that cross its 16-token windows, in chunks of 9."""
    from localserve.loading.hf import load_model
    from tests.helpers.gemma_models import gemma3_config
    from tests.helpers.models import save_random_model

    hf_model = save_random_model(tmp_path, gemma3_config()).to(torch.float64)
    model = load_model(tmp_path, dtype=torch.float64).model
    tokens, spans = image_prompt([[3, 5], (20, CAT), [11, 12, 13], (10, DOG), [40, 41]])
    [output] = run(make_engine(model, budget=9), [(tokens, spans)], StandInEncoder())
    assert list(output.token_ids) == greedy_reference(hf_model, tokens, spans, StandInEncoder(), 6)


def test_the_engine_thread_takes_images_and_refuses_bad_spans_at_once(tiny64, alone):
    import threading

    from localserve.engine.engine_thread import EngineThread

    thread = EngineThread(make_engine(tiny64))
    thread.start()
    try:
        done = threading.Event()
        final = []

        def on_output(output):
            if output.finished:
                final.append(output)
                done.set()

        tokens, spans = WORK[0]
        thread.submit(tokens, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), on_output,
                      multimodal=StandInEncoder().inputs(spans))
        assert done.wait(30) and list(final[0].token_ids) == alone[0]
        with pytest.raises(ValueError, match="image span 0 .* lies outside the prompt"):
            thread.submit([1, 2], SamplingParams(max_tokens=2), on_output,
                          multimodal=MultiModalInputs((ImageSpan(1, 4, b"a"),), [torch.zeros(4, HIDDEN)]))
    finally:
        thread.stop()


def test_without_an_embeddings_cache_images_are_encoded_again_and_give_the_same_tokens(tiny64, alone):
    encoder = StandInEncoder()
    engine = build_engine(tiny64, None, EngineConfig(num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=8,
                                                     image_cache_bytes=0, check_integrity=True))
    [output] = run(engine, [WORK[0]], encoder)
    assert list(output.token_ids) == alone[0]
    assert encoder.num_calls > 2 and len(engine.image_embeds) == 0


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_embedding_request_with_images_pools_transformers_hidden_states(tmp_path, pooling):
    """Embedding requests (prefilled, pooled: ModelRunner.execute_pooled) take images too, in chunks of 8."""
    from localserve.engine.embedding_params import EmbeddingParams
    from localserve.llm import LLM
    from tests.helpers.embedding_models import cosine, write_tiny_embedding_model

    reference = write_tiny_embedding_model(tmp_path, pooling)
    llm = LLM(str(tmp_path), device="cpu", engine_config=EngineConfig(
        num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=8, check_integrity=True))
    tokens, spans = image_prompt([[5, 6, 9], (20, CAT), [11, 12], (6, DOG), [30]])
    engine = llm.engine
    request_id = engine.add_request(tokens, EmbeddingParams(), multimodal=StandInEncoder().inputs(spans))
    vector = engine.run_to_completion()[request_id].embedding
    assert engine.is_idle_and_clean()
    encoder = StandInEncoder()
    with torch.no_grad():
        embeds = reference.embed_tokens(torch.tensor([tokens])).double()
        for offset, length, image in spans:
            embeds[0, offset:offset + length] = encoder.embed(image, length)
        hidden = reference.double()(inputs_embeds=embeds).last_hidden_state[0]
    expected = torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)
    assert cosine(vector, expected) > 0.9999


def test_an_image_ending_the_prompt_whose_last_token_alone_is_left(tiny64, hf64):
    """A prompt ending with an image whose last token alone is left to compute, after a chunk of 32 (it runs
    as a decode row) or after a prefix hit of 32 (a one-token prefill chunk): it takes its image row."""
    prompt = image_prompt([list(range(20, 36)), (17, CAT)])  # 33 tokens
    expected = greedy_reference(hf64, *prompt, StandInEncoder(), 6)
    engine = make_engine(tiny64, budget=32)
    encoder = StandInEncoder()
    [first] = run(engine, [prompt], encoder)
    [second] = run(engine, [prompt], encoder)
    assert second.num_cached_tokens == 32
    assert list(first.token_ids) == list(second.token_ids) == expected


def test_speculative_decoding_with_images_gives_the_same_tokens(tiny64):
    """Drafts verified over image prompts (a verify row may start on an image's last token), made by a draft
    model (the target itself) that sees the placeholders as text: its drafts are then often wrong, never
    wrongly kept."""
    from tests.helpers.spec_costs import FixedStepCost

    engine = build_engine(tiny64, None, EngineConfig(num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=32,
                                                     spec_type="draft", check_integrity=True), draft_model=tiny64)
    engine.scheduler.speculation.cost = FixedStepCost()
    work = WORK + [image_prompt([list(range(20, 36)), (17, CAT)])]
    outputs = run(engine, work, StandInEncoder(), max_tokens=24)
    expected = [list(run(make_engine(tiny64, prefix=False), [item], StandInEncoder(), 24)[0].token_ids)
                for item in work]
    assert [list(output.token_ids) for output in outputs] == expected
    counters = engine.stats().counters
    assert 0 < counters.spec_num_accepted_tokens < counters.spec_num_draft_tokens  # the images' drafts miss
