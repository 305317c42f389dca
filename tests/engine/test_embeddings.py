"""Embedding requests in the engine: prompt-only requests pooled from the final hidden states, batched with
generation requests in the same steps, equal to transformers' hidden states pooled the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localserve.engine.config import EngineConfig
from localserve.engine.embedding_params import EmbeddingParams
from localserve.engine.sampling_params import SamplingParams
from localserve.llm import LLM
from tests.helpers.embedding_models import cosine, reference_embedding, write_tiny_embedding_model

# Prompt lengths around the step budget (32) and the block size (16): one chunk, a block's edge, three chunks.
PROMPT_LENGTHS = (1, 5, 16, 17, 40, 75)


def prompt(length: int, offset: int = 0) -> list[int]:
    return [4 + (offset + 7 * i) % 250 for i in range(length)]


@pytest.fixture(scope="module", params=["last", "mean", "cls"])
def embedding_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"embed-{request.param}")
    reference = write_tiny_embedding_model(folder, request.param)
    llm = LLM(str(folder), device="cpu", engine_config=EngineConfig(
        num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=16, check_integrity=True))
    return request.param, llm, reference


def test_embeddings_equal_transformers_pooled_hidden_states(embedding_model):
    pooling, llm, reference = embedding_model
    prompts = [prompt(n, n) for n in PROMPT_LENGTHS]
    outputs = llm.embed(prompts)
    for tokens, output in zip(prompts, outputs):
        assert output.finished and output.error is None and output.outputs == []
        assert len(output.embedding) == 64
        assert cosine(output.embedding, reference_embedding(reference, tokens, pooling)) > 0.9999
    assert llm.engine.is_idle_and_clean()


def test_embeddings_batched_with_generation_leave_both_unchanged(embedding_model):
    """Embedding prompts (several chunks each) share steps with generation requests: the vectors equal the
    reference, the generated tokens equal those of the same requests run alone."""
    pooling, llm, reference = embedding_model
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    generation_prompts = [prompt(9, 1), prompt(30, 2), prompt(3, 3)]
    alone = [output.token_ids for output in llm.generate(generation_prompts, greedy)]
    engine = llm.engine
    generation_ids = [engine.add_request(tokens, greedy) for tokens in generation_prompts[:2]]
    embedding_prompts = [prompt(n, 3 * n) for n in (40, 75, 6)]
    embedding_ids = [engine.add_request(tokens, EmbeddingParams()) for tokens in embedding_prompts]
    generation_ids.append(engine.add_request(generation_prompts[2], greedy))
    shared_steps = 0
    final = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        record = engine.step_history[-1]
        shared_steps += record.num_prefill_tokens > 0 and record.num_tokens > record.num_prefill_tokens
        final |= {output.request_id: output for output in outputs if output.finished}
    assert shared_steps > 0  # some step held decodes and embedding chunks together
    assert [list(final[i].token_ids) for i in generation_ids] == [list(tokens) for tokens in alone]
    for request_id, tokens in zip(embedding_ids, embedding_prompts):
        assert cosine(final[request_id].embedding, reference_embedding(reference, tokens, pooling)) > 0.9999
    assert engine.is_idle_and_clean()


def test_cached_prefix_leaves_embeddings_unchanged(embedding_model):
    """A prompt whose leading blocks sit in the prefix cache (a generation request ran it) pools the same:
    mean and first-token pooling compute every token again, last-token pooling may take the hits."""
    pooling, llm, reference = embedding_model
    tokens = prompt(50, 11)
    llm.generate([tokens], SamplingParams(temperature=0, max_tokens=2))
    hits_before = llm.engine.block_manager.prefix_hit_tokens
    [output] = llm.embed([tokens])
    assert cosine(output.embedding, reference_embedding(reference, tokens, pooling)) > 0.9999
    took_hits = llm.engine.block_manager.prefix_hit_tokens > hits_before
    assert took_hits == (pooling == "last")
    assert llm.engine.is_idle_and_clean()


def test_blocks_an_embedding_prompt_leaves_in_the_prefix_cache_hold_the_right_kv(embedding_model):
    """Its full blocks enter the prefix cache: a generation request that takes them as hits generates what
    transformers generates from the whole prompt (its tied embeddings as the head)."""
    pooling, llm, reference = embedding_model
    tokens = prompt(40, 23)
    llm.embed([tokens])
    hits_before = llm.engine.block_manager.prefix_hit_tokens
    [output] = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert llm.engine.block_manager.prefix_hit_tokens - hits_before == 32  # both full blocks
    expected = list(tokens)
    with torch.no_grad():
        for _ in range(4):
            hidden = reference(torch.tensor([expected])).last_hidden_state[0, -1]
            expected.append(int((hidden @ reference.embed_tokens.weight.T).argmax()))
    assert list(output.token_ids) == expected[len(tokens):]


@pytest.fixture(scope="module")
def last_token_llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embed-matryoshka")
    reference = write_tiny_embedding_model(folder, "last")
    return LLM(str(folder), device="cpu", engine_config=EngineConfig(num_kv_blocks=8, max_model_len=64)), reference


def test_dimensions_truncate_and_renormalise(last_token_llm):
    llm, reference = last_token_llm
    tokens = prompt(20)
    [output] = llm.embed([tokens], EmbeddingParams(dimensions=16))
    assert len(output.embedding) == 16
    assert cosine(output.embedding, reference_embedding(reference, tokens, "last", dimensions=16)) > 0.9999
    assert sum(x * x for x in output.embedding) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(("tokens", "params", "message"), [
    ([], EmbeddingParams(), "the prompt is empty"),
    ([256], EmbeddingParams(), "outside the vocabulary"),
    (prompt(65), EmbeddingParams(), "exceeds the context length of 64"),
    (prompt(64), EmbeddingParams(dimensions=65), "dimensions: at most the model's 64"),
])
def test_embedding_requests_that_can_never_run_are_refused(last_token_llm, tokens, params, message):
    llm, _ = last_token_llm
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(tokens, params)
    assert llm.engine.is_idle_and_clean()


def test_the_context_length_is_a_bound_one_may_reach(last_token_llm):
    llm, reference = last_token_llm
    tokens = prompt(64)
    [output] = llm.embed([tokens], EmbeddingParams(dimensions=64))
    assert cosine(output.embedding, reference_embedding(reference, tokens, "last")) > 0.9999


def test_a_generation_model_refuses_embeddings_and_vice_versa(tmp_path, last_token_llm):
    from tests.helpers.server import make_llm, write_tiny_chat_model

    generation = make_llm(write_tiny_chat_model(tmp_path / "chat"))
    with pytest.raises(ValueError, match="not an embedding model"):
        generation.embed([prompt(4)])
    assert generation.engine.is_idle_and_clean()


def test_an_embedding_prompt_preempted_mid_prefill_pools_the_same(embedding_model):
    """Two generation requests outgrow a small pool while an embedding prompt is half prefilled: it is
    preempted by recompute, prefilled again from its start (or its cached blocks, for last-token pooling),
    and pools as if it had never been stopped; the generated tokens equal those of a run alone."""
    pooling, llm, reference = embedding_model
    # Blocks of 8 tokens: the generations need their third block (token 17) while the 35-token prompt,
    # 2 tokens a step beside their decodes, is still prefilling.
    small = LLM(str(llm.model_path), device="cpu", engine_config=EngineConfig(
        num_kv_blocks=9, block_size=8, max_num_batched_tokens=4, max_num_seqs=4, check_integrity=True))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    generation_prompts = [prompt(3, 1), prompt(3, 2)]
    alone = [list(output.token_ids) for output in small.generate(generation_prompts, greedy)]
    engine = small.engine
    generation_ids = [engine.add_request(tokens, greedy) for tokens in generation_prompts]
    tokens = prompt(35, 5)
    embedding_id = engine.add_request(tokens, EmbeddingParams())
    final = engine.run_to_completion()
    assert engine.num_preemptions == 1
    assert [list(final[i].token_ids) for i in generation_ids] == alone
    assert cosine(final[embedding_id].embedding, reference_embedding(reference, tokens, pooling)) > 0.9999
    assert engine.is_idle_and_clean()


def cuda_embeddings(path: Path, backend: str) -> list[list[float]]:
    """The embeddings of PROMPT_LENGTHS' prompts on CUDA in bfloat16, chunked beside a generation."""
    llm = LLM(str(path), device="cuda", dtype=torch.bfloat16, engine_config=EngineConfig(
        num_kv_blocks=64, max_num_batched_tokens=32, attention_backend=backend, check_integrity=True))
    engine = llm.engine
    engine.add_request(prompt(9, 1), SamplingParams(temperature=0, max_tokens=8))
    ids = [engine.add_request(prompt(n, n), EmbeddingParams()) for n in PROMPT_LENGTHS]
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    return [final[request_id].embedding for request_id in ids]


@pytest.mark.gpu
def test_embeddings_on_cuda_with_the_triton_backend(tmp_path):
    """The GPU path (Triton attention, bfloat16) pools as the torch backend does in the same dtype, and as
    the fp32 reference does within bfloat16's rounding (an H200 measured cosine 0.9984 against it)."""
    reference = write_tiny_embedding_model(tmp_path, "last")
    triton_embeddings = cuda_embeddings(tmp_path, "triton")
    torch_embeddings = cuda_embeddings(tmp_path, "torch")
    for n, by_triton, by_torch in zip(PROMPT_LENGTHS, triton_embeddings, torch_embeddings, strict=True):
        assert cosine(by_triton, by_torch) > 0.999
        assert cosine(by_triton, reference_embedding(reference, prompt(n, n), "last")) > 0.995
