"""Decode steps from static buffers (engine/cuda_graphs.py) against eager steps of the model runner.

On a CPU the static path runs without capture, its kernels in Triton's interpreter: everything but the
capture is checked here. The gpu-marked tests capture real graphs and count the step's copies.
"""

from __future__ import annotations

import pytest
import torch

from localserve.attention.triton_backend import TritonAttentionBackend
from localserve.engine.builder import build_kv_cache
from localserve.engine.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs
from localserve.engine.model_runner import ModelRunner
from localserve.engine.step import SeqChunk, StepInput
from localserve.kv.cache import PagedKVCache
from localserve.kv.formats import KVFormatSpec
from localserve.loading.hf import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT_LENS = [15, 3, 30]  # the first crosses a block boundary at its first decode step
TABLES = [[4, 9], [2, 7], [0, 11, 5]]


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    """A tiny Qwen3 (head dim 32) in float32."""
    return load_model(tiny_model_dir("qwen3")[0], dtype=torch.float32, device=DEVICE).model


def make_cache(model, k_type: str, v_type: str) -> PagedKVCache:
    return build_kv_cache(model, None, KVFormatSpec.parse(k_type), KVFormatSpec.parse(v_type), num_blocks=12,
                          block_size=16)


def prefilled(model, k_type: str, v_type: str) -> tuple[ModelRunner, list[int]]:
    """An eager Triton runner whose pool holds three prompts; their first sampled tokens."""
    runner = ModelRunner(model, make_cache(model, k_type, v_type), TritonAttentionBackend())
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    logits = runner.execute(StepInput([SeqChunk(p, 0, t) for p, t in zip(prompts, TABLES)]))
    return runner, logits.argmax(-1).tolist()


def decode_step(tokens: list[int], lengths: list[int], rows: list[int]) -> StepInput:
    return StepInput([SeqChunk([tokens[i]], lengths[i], TABLES[i]) for i in rows])


@pytest.mark.parametrize("k_type,v_type", [("fp32", "bf16"), ("q4_rot", "q8_0")])
def test_static_decode_steps_equal_eager_ones(qwen3, k_type, v_type):
    eager, tokens = prefilled(qwen3, k_type, v_type)
    static, static_tokens = prefilled(qwen3, k_type, v_type)
    assert static_tokens == tokens
    graphs = DecodeGraphs(qwen3, static.kv_cache, static.backend, max_model_len=64, capture=False)
    lengths = list(PROMPT_LENS)
    for rows in ([0, 1, 2], [0, 2], [1]):  # padded to 4, 2 and 1 rows
        step = decode_step(tokens, lengths, rows)
        assert graphs.can_run(step)
        before = {name: t.clone() for name, t in static.kv_cache.key_stores[0].items()}
        expected = eager.execute(step)
        logits = graphs.run(step)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        written = {TABLES[i][lengths[i] // 16] * 16 + lengths[i] % 16 for i in rows}
        for name, tensor in static.kv_cache.key_stores[0].items():  # padding rows wrote nowhere
            changed = (tensor != before[name]).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
            assert set(changed) <= written, name
        for i in rows:
            tokens[i] = int(expected[rows.index(i)].argmax())
            lengths[i] += 1


def test_only_decode_steps_that_fit_run_from_graphs(qwen3):
    runner, tokens = prefilled(qwen3, "fp32", "fp32")
    graphs = DecodeGraphs(qwen3, runner.kv_cache, runner.backend, max_model_len=48, capture=False)
    assert graphs.table_width == 3
    assert not graphs.can_run(StepInput([SeqChunk([1, 2], 15, TABLES[0])]))  # a prefill chunk
    assert not graphs.can_run(StepInput([SeqChunk([1], 15, TABLES[0], needs_logits=False)]))
    assert not graphs.can_run(StepInput([SeqChunk([1], 47, [0, 1, 2, 3])]))  # wider than max_model_len
    assert not graphs.can_run(StepInput([SeqChunk([1], 3, [0])] * (MAX_GRAPH_BATCH + 1)))
    assert not graphs.can_run(StepInput())
    assert graphs.can_run(StepInput([SeqChunk([1], 3, [0])] * MAX_GRAPH_BATCH))


@pytest.mark.gpu
def test_captured_graphs_replay_eager_steps_with_one_host_to_device_copy(qwen3):
    eager, tokens = prefilled(qwen3, "q4_rot", "q4_rot")
    captured, _ = prefilled(qwen3, "q4_rot", "q4_rot")
    graphs = DecodeGraphs(qwen3, captured.kv_cache, captured.backend, max_model_len=64)
    lengths = list(PROMPT_LENS)
    for step_index in range(4):
        step = decode_step(tokens, lengths, [0, 1, 2])
        expected = eager.execute(step)
        if step_index == 0:
            logits = graphs.run(step)  # captures size 4
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                logits = graphs.run(step)
                torch.cuda.synchronize()
            copies = [e for e in profile.events() if "HtoD" in e.name or "Memcpy HtoD" in e.name]
            assert len(copies) == 1, [e.name for e in profile.events()]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        tokens = expected.argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    assert set(graphs.graphs) == {4} and graphs.graphs[4].graph is not None
