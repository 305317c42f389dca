"""The Triton backend inside the engine: choice by `auto`, and whole runs against the torch backend.

On a CPU the kernels run in Triton's interpreter (tests/conftest.py), so the engine runs here take a
tiny model and a few short requests; on CUDA the same tests run compiled.
"""

from __future__ import annotations

import pytest
import torch

from localserve.attention import select_backend
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.attention.triton_backend import TritonAttentionBackend
from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.kv.formats import KVFormatSpec
from localserve.loading.hf import load_model

spec = KVFormatSpec.parse  # the backends take parsed KV formats
FP16 = spec("fp16")
PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 250, 77, 12, 9, 31, 200, 18, 4, 66, 91, 120, 33, 7],
           [11, 13, 17, 19, 23], [200, 199, 198, 197, 196, 195, 194, 193, 192, 191, 190, 189, 188, 187, 186, 185,
                                   184, 183, 182, 181, 180, 179, 178, 177, 176, 175, 174, 173, 172, 171, 170, 169,
                                   168, 167, 166],
           [1, 2, 3]]


def test_auto_passes_over_triton_on_a_cpu_and_says_why():
    backend, why = select_backend("auto", torch.device("cpu"), spec("q8_0"), spec("q4_rot"), head_dim=64)
    assert isinstance(backend, TorchAttentionBackend)
    assert "not triton: its kernels compile for CUDA devices only" in why
    with pytest.raises(ValueError, match="'triton' cannot run here: its kernels compile for CUDA devices only"):
        select_backend("triton", torch.device("cpu"), spec("fp16"), spec("fp16"), head_dim=64)


@pytest.mark.gpu
@pytest.mark.parametrize("k_type,v_type", [("bf16", "bf16"), ("fp16", "q8_0"), ("q4_rot", "q4_rot:-mean"),
                                           ("fp32", "q8_0:-rotation")])
def test_auto_picks_triton_on_cuda_for_every_format_it_reads(k_type, v_type):
    backend, why = select_backend("auto", torch.device("cuda"), spec(k_type), spec(v_type), head_dim=64)
    assert isinstance(backend, TritonAttentionBackend) and why.startswith("triton (auto")


@pytest.mark.gpu
def test_auto_keeps_torch_for_a_format_the_kernels_do_not_read():
    backend, why = select_backend("auto", torch.device("cuda"), spec("fp64"), spec("fp16"), head_dim=64)
    assert isinstance(backend, TorchAttentionBackend) and "not triton: its kernels do not read a fp64" in why


@pytest.mark.parametrize("head_dim", [80, 8, 1024])
def test_auto_keeps_torch_for_a_head_size_the_kernels_do_not_take(head_dim):
    reason = TritonAttentionBackend.unsupported_reason(torch.device("cuda"), FP16, FP16, head_dim)
    assert reason == f"its kernels need a head size that is a power of two from 16 to 512, this model's is {head_dim}"
    for taken in (16, 128, 256, 512):
        assert TritonAttentionBackend.unsupported_reason(torch.device("cuda"), FP16, FP16, taken) is None


def test_auto_serves_a_model_with_a_layer_the_kernels_cannot_take_with_torch_and_says_which():
    from localserve.attention.base import AttentionGeometry

    layers = [AttentionGeometry(8, 2, 128, 0.1), AttentionGeometry(8, 1, 512, 0.1, keys_are_values=True),
              AttentionGeometry(8, 2, 96, 0.1, sliding_window=4)]
    backend, why = select_backend("auto", torch.device("cuda"), FP16, FP16, 128, layers)
    assert isinstance(backend, TorchAttentionBackend)
    assert "not triton: its kernels need a head size that is a power of two from 16 to 512, layer 2's is 96" in why


class TorchWriteTritonAttend(TritonAttentionBackend):
    """Stores K/V with the torch codecs, then attends with the Triton kernel: against the torch backend,
    both attend over the very same stored bytes."""

    def forward(self, layer, query, key, value, kv_cache, metadata, geometry=None):
        kv_cache.write(layer, key, value, metadata.inputs.slot_mapping, metadata.inputs.positions)
        return self.attend(layer, query, kv_cache, metadata, None if geometry is None else geometry.scale)


def greedy_tokens(model, backend, k_type: str, v_type: str) -> list[list[int]]:
    """Four greedy requests run together, with chunked prefill (budget 24) mixing chunks and decodes."""
    config = EngineConfig(num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=24, cache_type_k=k_type,
                          cache_type_v=v_type, attention_backend="torch", check_integrity=True)
    engine = build_engine(model, None, config)
    if backend is not None:
        engine.runner.backend = backend  # the kernels run in the interpreter here, which auto never picks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in PROMPTS]
    outputs = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    return [outputs[i].token_ids for i in ids]


@pytest.fixture(scope="module")
def tiny_models(tiny_model_dir):
    """A tiny Llama (head dim 16) and a tiny Qwen3 (head dim 32, for q8_0's 32-value groups), float32."""
    return {arch: load_model(tiny_model_dir(arch)[0], dtype=torch.float32).model for arch in ("llama", "qwen3")}


@pytest.mark.parametrize("arch,k_type,v_type", [("llama", "fp32", "fp32"), ("qwen3", "bf16", "fp16")])
def test_engine_greedy_tokens_equal_the_torch_backend(tiny_models, arch, k_type, v_type):
    model = tiny_models[arch]
    expected = greedy_tokens(model, None, k_type, v_type)
    assert greedy_tokens(model, TritonAttentionBackend(), k_type, v_type) == expected


@pytest.mark.parametrize("arch,k_type,v_type", [("llama", "q4_rot", "q4_rot"), ("qwen3", "q8_0", "q4_rot")])
def test_engine_quantized_tokens_equal_torch_over_the_same_bytes(tiny_models, arch, k_type, v_type):
    model = tiny_models[arch]
    expected = greedy_tokens(model, None, k_type, v_type)
    assert greedy_tokens(model, TorchWriteTritonAttend(num_splits=2), k_type, v_type) == expected


@pytest.mark.gpu
@pytest.mark.slow
def test_default_model_on_cuda_gives_the_torch_backends_greedy_tokens(smollm2_path):
    """SmolLM2 in fp32 on CUDA: auto (Triton, decode steps from CUDA graphs) against the torch backend."""
    model = load_model(smollm2_path, dtype=torch.float32, device="cuda").model
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 1953, 30], list(range(100, 160))]
    results = {}
    for backend in ("auto", "torch"):
        engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=4, attention_backend=backend,
                                                     max_model_len=512))
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        outputs = engine.run_to_completion()
        results[backend] = [outputs[i].token_ids for i in ids]
        if backend == "auto":
            assert isinstance(engine.runner.backend, TritonAttentionBackend)
            assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.graphs
    assert results["auto"] == results["torch"]
