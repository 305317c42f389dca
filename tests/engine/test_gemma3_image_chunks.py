"""The chunk rule of bidirectional image spans (engine/batch.py, `span_safe_chunk`) on generated work: spans
of any length up to the step budget, budgets, block sizes and prefix hits (a second wave: first-wave prompts
whole and more parts, so hits may land inside images). Through the engine with the tiny Gemma 3 (float64: no
near-tie flips between batchings): no chunk ends strictly inside a bidirectional span, every prompt token is
computed once, every step passes tests/helpers/engine_checks.py, the engine ends idle with every block back,
and each request's greedy tokens are those of a one-step-per-prompt engine without the prefix cache. Fixed
examples at the bound: a span as long as the budget runs, one a token longer is refused naming the span."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from localserve.engine.batch import span_safe_chunk
from localserve.engine.multimodal import ImageSpan, MultiModalInputs
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from tests.helpers.engine_checks import StepChecker
from tests.helpers.gemma_image_engine import IMAGE_TOKEN, make_engine, write_gemma3_image_model

HIDDEN = 64
MAX_SPAN = 16  # the tiny model's window


@pytest.fixture(scope="module")
def gemma3_text64(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_chunks")
    write_gemma3_image_model(folder)
    return load_model(folder, dtype=torch.float64).model


def embeddings_of(seed: int, length: int) -> torch.Tensor:
    return torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def build(parts: list, placeholder: int = IMAGE_TOKEN) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Parts: token lists (text) and (seed, length) images -> ids and (offset, length, seed) spans."""
    tokens, spans = [2], []
    for part in parts:
        if isinstance(part, tuple):
            spans.append((len(tokens), part[1], part[0]))
            tokens += [placeholder] * part[1]
        else:
            tokens += part
    return tokens, spans


def inputs(spans: list[tuple[int, int, int]]) -> MultiModalInputs | None:
    if not spans:
        return None
    return MultiModalInputs(
        tuple(ImageSpan(offset, length, hashlib.sha256(f"{seed}:{length}".encode()).digest(), True)
              for offset, length, seed in spans),
        lambda index: embeddings_of(spans[index][2], spans[index][1]))


def text(max_size: int = 6):
    return st.lists(st.integers(3, 300), min_size=1, max_size=max_size)


def image(max_length: int):
    return st.tuples(st.integers(0, 2), st.integers(1, max_length))  # 3 pictures: the same one recurs


def prompts(max_length: int):
    return st.lists(st.one_of(text(), image(max_length)), min_size=1, max_size=5)


def record_chunks(engine) -> list[tuple[str, int, int]]:
    """(request id, start, end) of every row the engine computes, in order (wraps the scheduler's
    mark_computed, which sees each step's rows after the forward pass)."""
    seen: list[tuple[str, int, int]] = []
    mark_computed = engine.scheduler.mark_computed

    def recording(batch):
        for row in batch.rows:
            seen.append((row.request.request_id, row.chunk.start_pos, row.chunk.start_pos + row.query_len))
        mark_computed(batch)

    engine.scheduler.mark_computed = recording
    return seen


def check_chunks(seen, requests: dict[str, tuple[list[int], list]], cached: dict[str, int]) -> None:
    for request_id, (tokens, spans) in requests.items():
        rows = [(start, end) for rid, start, end in seen if rid == request_id and start < len(tokens)]
        for start, end in rows:
            for offset, length, _ in spans:
                assert not offset < end < offset + length, f"{request_id}: a chunk [{start}, {end}) ends inside " \
                                                          f"the span [{offset}, {offset + length})"
        # Every prompt token once: from the cached ones on, each chunk where the last one ended.
        position = cached[request_id]
        for start, end in rows:
            assert start == position, f"{request_id}: chunks {rows}, {cached[request_id]} cached"
            position = end
        assert position >= len(tokens)


@given(budget=st.integers(MAX_SPAN, 40), block_size=st.sampled_from([4, 8, 16]), data=st.data())
@example(budget=MAX_SPAN, block_size=8, data=None)  # spans as long as the budget, a hit inside one
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
def test_generated_work_never_ends_a_chunk_inside_an_image(gemma3_text64, budget, block_size, data):
    if data is None:  # the second request's hit (two blocks of 8) ends inside the image [4, 20)
        first = [build([[5, 6, 7], (0, MAX_SPAN), [8]]), build([(1, 3), [9, 10], (0, MAX_SPAN)])]
        later = [(first[0], [[11, 12]])]
    else:
        first = [build(parts) for parts in data.draw(st.lists(prompts(MAX_SPAN), min_size=1, max_size=3))]
        later = [(data.draw(st.sampled_from(first)), parts)
                 for parts in data.draw(st.lists(prompts(MAX_SPAN), min_size=0, max_size=3))]
    engine = make_engine(gemma3_text64, budget=budget, block_size=block_size)
    seen = record_chunks(engine)
    checker = StepChecker(engine)  # every step against the scheduling rules (budget, moves, work conservation)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    requests, cached, outputs = {}, {}, {}

    def wave(work):
        ids = []
        for tokens, spans in work:
            request_id = engine.add_request(tokens, params, multimodal=inputs(spans))
            requests[request_id] = (tokens, spans)
            ids.append(request_id)
        final = {}
        while engine.has_unfinished_requests():
            final.update((output.request_id, output) for output in engine.step() if output.finished)
            checker.after_step()
        assert engine.is_idle_and_clean()
        for request_id in ids:
            cached[request_id] = final[request_id].num_cached_tokens
            outputs[request_id] = list(final[request_id].outputs[0].token_ids)

    wave(first)
    second = []
    for (base_tokens, base_spans), parts in later:  # a first-wave prompt whole, then more parts
        extra_tokens, extra_spans = build(parts)
        second.append((base_tokens + extra_tokens[1:], base_spans + [(offset - 1 + len(base_tokens), length, seed)
                                                                     for offset, length, seed in extra_spans]))
    wave(second)
    if data is None:
        assert cached[list(requests)[-1]] == 16
    check_chunks(seen, requests, cached)
    # The same tokens as one step per prompt, no cache: the rule kept each image whole.
    whole = make_engine(gemma3_text64, budget=512, block_size=block_size, prefix=False)
    ids = {request_id: whole.add_request(tokens, params, multimodal=inputs(spans))
           for request_id, (tokens, spans) in requests.items()}
    final = whole.run_to_completion()
    assert {request_id: list(final[other].outputs[0].token_ids) for request_id, other in ids.items()} == outputs


@pytest.mark.parametrize("length, refused", [(MAX_SPAN, False), (MAX_SPAN + 1, True)])
def test_a_span_at_the_budget_runs_and_one_past_it_is_refused(gemma3_text64, length, refused):
    engine = make_engine(gemma3_text64, budget=MAX_SPAN)
    tokens, spans = build([[5, 6], (0, length), [7]])
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    if refused:
        with pytest.raises(ValueError, match=rf"image span 0 \(tokens \[3, {3 + length}\)\) is bidirectional and "
                                             rf"{length} tokens long, more than a step's {MAX_SPAN} tokens"):
            engine.add_request(tokens, params, multimodal=inputs(spans))
        assert not engine.has_unfinished_requests()
        return
    seen = record_chunks(engine)
    request_id = engine.add_request(tokens, params, multimodal=inputs(spans))
    engine.run_to_completion()
    assert engine.is_idle_and_clean()
    # The first chunk ends at the image's start (3 tokens), the image takes a step of its own, then the rest.
    assert [(start, end) for _, start, end in seen][:3] == [(0, 3), (3, 3 + length), (3 + length, 4 + length)]
    check_chunks(seen, {request_id: (tokens, spans)}, {request_id: 0})


# (spans, start, num_tokens, slotted, budget_left) -> the chunk's length
@pytest.mark.parametrize("spans, start, num_tokens, slotted, budget_left, expected", [
    (((4, 20),), 0, 16, 99, 16, 4),  # ends inside a span after its start: at the span's start
    (((4, 20),), 0, 20, 99, 20, 20),  # ends at the span's end: as it is
    (((4, 20),), 0, 4, 99, 4, 4),  # ends at the span's start: as it is
    (((4, 20),), 4, 8, 99, 8, 0),  # starts at the span, its rest (16) past the budget left beside another prefill
    (((4, 20),), 4, 8, 99, None, 16),  # the step's first prefill: the rest whole, past the budget
    (((4, 20),), 16, 2, 99, 2, 0),  # a hit inside: the rest (4) past the budget left
    (((4, 20),), 16, 2, 99, 4, 4),  # a hit inside: the rest fits
    (((4, 20),), 16, 2, 3, None, 0),  # the rest has no KV slots yet (a window group's pool): wait
    (((0, 3), (5, 9), (12, 30)), 0, 7, 99, 7, 5),  # the second span cut: before it, the first whole
    (((0, 3), (5, 9), (12, 30)), 9, 10, 99, 10, 3),  # after the second, into the third: to its start
    ((), 0, 7, 99, 7, 7),
])
def test_span_safe_chunk(spans, start, num_tokens, slotted, budget_left, expected):
    assert span_safe_chunk(spans, start, num_tokens, slotted, budget_left) == expected


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 20)), max_size=4), st.integers(0, 80),
       st.integers(1, 40), st.integers(1, 60), st.one_of(st.none(), st.integers(1, 40)))
def test_span_safe_chunk_never_ends_inside_a_span(gaps_and_lengths, start, num_tokens, slotted, budget_left):
    spans, position = [], 0
    for gap, length in gaps_and_lengths:
        spans.append((position + gap, position + gap + length))
        position += gap + length
    length = span_safe_chunk(tuple(spans), start, min(num_tokens, slotted), slotted, budget_left)
    end = start + length
    assert 0 <= length <= slotted
    if length:
        assert not any(offset < end < span_end for offset, span_end in spans)
    if length > num_tokens:  # only the rest of a span the chunk starts at or in, within the budget's rule
        assert any(offset <= start and end == span_end for offset, span_end in spans)
        assert budget_left is None or length <= budget_left


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_embedding_request_with_bidirectional_images(tmp_path, pooling):
    """Embedding requests follow the same rule (chunks of 8 around spans of 8 and 5): their vectors are
    transformers' hidden states pooled, under a mask of causal OR same image (a 4D mask it takes as given)."""
    from localserve.engine.config import EngineConfig
    from localserve.engine.embedding_params import EmbeddingParams
    from localserve.llm import LLM
    from tests.helpers.embedding_models import cosine, write_tiny_embedding_model

    reference = write_tiny_embedding_model(tmp_path, pooling)
    llm = LLM(str(tmp_path), device="cpu", engine_config=EngineConfig(
        num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=8, check_integrity=True))
    tokens, spans = build([[5, 6, 9], (0, 8), [11, 12], (1, 5), [30]], placeholder=7)
    engine = llm.engine
    vectors = {}
    for bidirectional in (True, False):
        multimodal = inputs(spans)
        if not bidirectional:
            # Other hashes: the causal run must not hit the blocks the bidirectional one left in the cache.
            causal = tuple(ImageSpan(span.offset, span.length, b"causal" + span.content_hash)
                           for span in multimodal.spans)
            multimodal = MultiModalInputs(causal, multimodal.embeddings)
        request_id = engine.add_request(tokens, EmbeddingParams(), multimodal=multimodal)
        vectors[bidirectional] = engine.run_to_completion()[request_id].embedding
        assert engine.is_idle_and_clean()
    with torch.no_grad():
        embeds = reference.embed_tokens(torch.tensor([tokens])).double()
        positions = torch.arange(len(tokens))
        seen = positions[None, :] <= positions[:, None]
        for offset, length, seed in spans:
            embeds[0, offset:offset + length] = embeddings_of(seed, length)
            inside = (positions >= offset) & (positions < offset + length)
            seen |= inside[:, None] & inside[None, :]
        hidden = reference.double()(inputs_embeds=embeds, attention_mask=seen[None, None]).last_hidden_state[0]
    expected = torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)
    assert cosine(vectors[True], expected) > 0.9999
    assert cosine(vectors[False], expected) < 0.9999  # the mask matters
