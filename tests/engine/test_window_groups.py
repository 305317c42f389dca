"""Layer groups through the engine: a tiny Qwen2 from transformers' own config class whose layers alternate
a 16-token sliding window with full attention, against transformers' greedy generation, for prompts and
generations several windows long: alone and batched, chunked prefill across the window's edge, preemption
by recompute and by swap, speculative decoding, the prefix cache (a second turn hits it and answers as
without it), and bounded memory (a 4,096-token generation holds at most ceil(16 / 16) + 1 blocks of the
window group at every step, checked by the integrity check after every step)."""

from __future__ import annotations

import random

import pytest
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.kv.layer_groups import max_blocks_in_window
from localserve.loading.hf import load_model
from tests.helpers.engine_checks import run_requests
from tests.helpers.models import save_random_model
from tests.helpers.spec_costs import FixedStepCost

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def window_model(tmp_path_factory):
    """(localserve model, transformers model) of a 3-layer Qwen2, window 16 on layers 0 and 2, in float64."""
    import transformers

    folder = tmp_path_factory.mktemp("qwen2-window")
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=1,
        eos_token_id=2, use_sliding_window=True, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        attn_implementation="eager")
    hf_model = save_random_model(folder, config, dtype=torch.float64)
    model = load_model(folder, dtype=torch.float64).model
    return model, hf_model


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def requests(seed: int, count: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 256) for _ in range(70)]
    out = []
    for index in range(count):
        prompt = base[:rng.randint(20, 70)] if index % 2 else [rng.randrange(3, 256) for _ in range(rng.randint(1, 60))]
        out.append((prompt, SamplingParams(temperature=0, max_tokens=rng.randint(20, 50), ignore_eos=True)))
    return out


def outputs(model, reqs, **config) -> tuple[list[list[int]], object]:
    engine = build_engine(model, None, EngineConfig(check_integrity=True, **config))
    if engine.scheduler.speculation is not None:
        engine.scheduler.speculation.cost = FixedStepCost()  # draft whatever this machine's speed
    results = run_requests(engine, reqs, check=True)
    return [list(result.outputs[0].token_ids) for result in results], engine


def test_the_config_becomes_a_full_group_and_a_window_group(window_model):
    model, _ = window_model
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32))
    assert engine.block_manager.group_windows == (None, WINDOW)
    assert engine.runner.kv_cache.layer_groups == [1, 0, 1]
    # The window pool: 4 slots x (ceil((16 + 32 - 1) / 16) + 1): each slot's window and one prefill chunk.
    assert engine.block_manager.group_num_blocks == (64, 16)
    assert [store["values"].shape[0] for store in engine.runner.kv_cache.key_stores] == [16, 64, 16]
    assert model.config.context_length == 8192  # no longer capped by the window


def test_greedy_alone_and_batched_with_chunks_across_the_window_edge_equals_transformers(window_model):
    model, hf_model = window_model
    reqs = requests(seed=0, count=6)
    expected = [hf_greedy(hf_model, prompt, params.max_tokens) for prompt, params in reqs]
    alone = [outputs(model, [req], num_kv_blocks=64, max_num_seqs=1)[0][0] for req in reqs]
    assert alone == expected
    # Chunks of 8 tokens: prefill chunks start inside, at and past the window's edge.
    batched, engine = outputs(model, reqs, num_kv_blocks=64, max_num_seqs=6, max_num_batched_tokens=8)
    assert batched == expected
    assert engine.block_manager.prefix_hit_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_output(window_model, mode):
    model, _ = window_model
    reqs = requests(seed=1, count=8)
    expected, _ = outputs(model, reqs, num_kv_blocks=128, max_num_seqs=8)
    got, engine = outputs(model, reqs, num_kv_blocks=12, num_cpu_blocks=24, max_num_seqs=8,
                          max_num_batched_tokens=32, preemption_mode=mode)
    assert engine.num_preemptions > 0
    assert got == expected


def test_speculative_decoding_keeps_greedy_output(window_model):
    model, _ = window_model
    rng = random.Random(2)
    reqs = []
    for _ in range(6):  # repeating prompts: the n-gram drafter finds matches
        piece = [rng.randrange(3, 256) for _ in range(rng.randint(2, 5))]
        reqs.append(((piece * 20)[:rng.randint(20, 60)], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    expected, _ = outputs(model, reqs, num_kv_blocks=128, max_num_seqs=6)
    got, engine = outputs(model, reqs, num_kv_blocks=32, max_num_seqs=6, spec_type="ngram", spec_tokens=5)
    totals = engine.scheduler.speculation.totals
    assert totals.num_drafts > 10 and 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    assert got == expected


def test_the_second_turn_of_a_conversation_hits_the_prefix_cache_and_answers_as_without_it(window_model):
    model, hf_model = window_model
    rng = random.Random(3)
    first_turn = [rng.randrange(3, 256) for _ in range(45)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, check_integrity=True))
    answer = list(run_requests(engine, [(first_turn, params)], check=True)[0].outputs[0].token_ids)
    second_turn = first_turn + answer + [rng.randrange(3, 256) for _ in range(12)]
    # (A step checker's pool model starts empty: it would not know the first turn's cached blocks; the
    # integrity check still runs after every step.)
    [result] = run_requests(engine, [(second_turn, params)], check=False)
    assert result.num_cached_tokens >= 64  # the first turn's blocks, found again (the window's among them)
    uncached = build_engine(model, None, EngineConfig(num_kv_blocks=64, enable_prefix_caching=False))
    [reference] = run_requests(uncached, [(second_turn, params)], check=False)
    assert list(result.outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert list(result.outputs[0].token_ids) == hf_greedy(hf_model, second_turn, 30)


def test_a_4096_token_generation_holds_the_window_groups_blocks_bounded_at_every_step(window_model):
    model, _ = window_model
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=260, max_num_seqs=1, check_integrity=True))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
    bound = max_blocks_in_window(WINDOW, 16)
    assert bound == 2
    most_held = 0
    while engine.has_unfinished_requests():
        engine.step()  # the integrity check runs after every step: the window bound included
        full, window = engine.block_manager.group_usage()
        assert window.num_used_blocks <= bound
        most_held = max(most_held, window.num_used_blocks)
    assert most_held == bound and full.num_used_blocks == 0


def test_the_snapshot_facts_and_metrics_show_each_groups_blocks(window_model):
    from localserve.engine.facts import read_facts
    from localserve.engine.snapshot import read_snapshot, read_stats
    from localserve.server.monitor.metrics import ServerMetrics

    model, _ = window_model
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32))
    engine.add_request(list(range(3, 60)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    facts = read_facts(engine)
    assert [(g.label, g.num_layers, g.num_blocks) for g in facts.kv_groups] == [("full", 1, 64), ("window 16", 2, 16)]
    assert facts.num_gpu_blocks == 80
    per_layer = 2 * 16 * 2 * 8  # KV heads x head size x (K, V) x float64
    assert facts.kv_cache_bytes == 16 * per_layer * (64 + 2 * 16)
    full, window = read_stats(engine).gauges.kv_groups
    assert full.num_used_blocks == 4 and 0 < window.num_used_blocks <= 3  # 57 prompt tokens: keys 41.. held
    snapshot = read_snapshot(engine)
    assert len(engine.block_manager.snapshot().block_states) == 80
    assert snapshot.to_json()["gauges"]["kv_groups"][1]["sliding_window"] == WINDOW
    text = ServerMetrics("tiny").render(read_stats(engine)).decode()
    assert f'localserve_kv_group_blocks{{group="window 16",model_name="tiny",state="used"}} ' \
           f'{float(window.num_used_blocks)}' in text
    assert 'localserve_kv_group_blocks{group="full",model_name="tiny",state="free"} 60.0' in text


def test_a_prompt_longer_than_the_window_pool_is_admitted_and_answers_as_transformers(window_model):
    """The window pool (2 slots x (ceil((16 + 16 - 1) / 16) + 1) = 6 blocks) is far smaller than the prompt's
    19 blocks: admission counts each group's pool on its own, and the window group takes slots a chunk at
    a time."""
    model, hf_model = window_model
    rng = random.Random(4)
    prompt = [rng.randrange(3, 256) for _ in range(300)]
    got, engine = outputs(model, [(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))],
                          num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=16)
    assert engine.block_manager.group_num_blocks == (64, 6)
    assert got == [hf_greedy(hf_model, prompt, 20)]


def test_a_model_wide_window_is_a_window_on_every_layer(tmp_path):
    """Qwen2's `use_sliding_window` from layer 0 on (Mistral's model-wide window alike): one window group,
    no full one; the context is no longer capped by the window."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, attn_implementation="eager")
    hf_model = save_random_model(tmp_path, config, seed=5, dtype=torch.float64)
    model = load_model(tmp_path, dtype=torch.float64).model
    assert model.config.sliding_window == WINDOW and model.config.context_length == 4096
    rng = random.Random(5)
    reqs = [([rng.randrange(3, 256) for _ in range(length)], SamplingParams(temperature=0, max_tokens=40,
                                                                           ignore_eos=True)) for length in (40, 57)]
    got, engine = outputs(model, reqs, num_kv_blocks=12, max_num_seqs=2, max_num_batched_tokens=16)
    assert engine.block_manager.group_windows == (WINDOW,)
    assert got == [hf_greedy(hf_model, prompt, 40) for prompt, _ in reqs]
