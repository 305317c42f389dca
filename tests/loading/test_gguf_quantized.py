"""--keep-quantized-weights: a GGUF's quantized weights stay in their blocks on the device, and the model
gives what the dequantized model gives (the kernels run in Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from localserve.models.layers.linear import QuantizedEmbedding, QuantizedLinear

from localserve.loading.hf import ModelLoadError, load_model
from tests.helpers.gguf import write_random_gguf
from tests.helpers.models import greedy_paged, make_runner

# Every type the kernels read, in one two-layer model; the embeddings tied (Q6_K) or not (Q4_K, with an
# output layer in Q8_0), and one dense F16 layer that stays dense.
EVERY_TYPE = {"blk.0.attn_q": "Q4_0", "blk.0.attn_k": "Q4_1", "blk.0.attn_v": "Q5_0", "blk.0.attn_output": "Q5_1",
              "blk.0.ffn_gate": "Q8_0", "blk.0.ffn_up": "Q2_K", "blk.0.ffn_down": "Q3_K", "blk.1.attn_q": "Q4_K",
              "blk.1.attn_k": "Q5_K", "blk.1.attn_v": "Q6_K", "blk.1.attn_output": "MXFP4", "blk.1.ffn_gate": "Q5_K",
              "blk.1.ffn_up": "Q4_K", "blk.1.ffn_down": "F16"}
VARIANTS = {"llama-tied": ("llama", True, EVERY_TYPE | {"token_embd": "Q6_K"}),
            "qwen2-untied": ("qwen2", False, EVERY_TYPE | {"token_embd": "Q4_K", "output": "Q8_0"})}


def quantized_modules(model) -> dict[str, str]:
    return {name: module.format.name for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_type_kept_quantized_gives_the_dequantized_models_tokens(tmp_path, variant):
    arch, tied, weight_types = VARIANTS[variant]
    path = tmp_path / f"{variant}.gguf"
    write_random_gguf(path, arch, weight_types, tied)
    quantized, runner_quantized = make_runner(path, keep_quantized_weights=True)
    dequantized, runner_dequantized = make_runner(path, keep_quantized_weights=False)

    kept = quantized_modules(quantized.model)
    expected = {name for name, qtype in weight_types.items() if qtype != "F16"}
    assert len(kept) == len(expected) and not quantized_modules(dequantized.model)
    assert isinstance(quantized.model.model.embed_tokens, QuantizedEmbedding) and (tied == (
        not hasattr(quantized.model, "lm_head")))
    # The kept blocks (Q and K rows un-permuted as whole rows) dequantize to the dequantized model's weights.
    dense = dict(dequantized.model.named_parameters())
    for name in kept:
        module = quantized.model.get_submodule(name)
        assert torch.equal(module.dequantized_weight(torch.float32), dense[f"{name}.weight"]), name
        if arch == "qwen2" and name.endswith(("q_proj", "k_proj", "v_proj")):
            assert torch.equal(module.bias, dense[f"{name}.bias"])

    prompt, table, logits, reference = [1, 17, 200, 45, 9, 130], list(range(4)), [], []
    tokens = greedy_paged(runner_quantized, prompt, 4, table, logits)  # 6 rows of x, then 1: scratch, gemv
    assert tokens == greedy_paged(runner_dequantized, prompt, 4, table, reference)
    logits, reference = torch.cat(logits), torch.cat(reference)
    assert (logits - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_default_off_on_the_cpu_and_a_clear_error_without_the_interpreter(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_random_gguf(path, "llama", {"blk.0.attn_q": "Q4_K", "token_embd": "Q8_0"}, tied=True, num_layers=1)
    assert not quantized_modules(load_model(path).model)  # a CPU device: dequantized as before
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ModelLoadError, match="--keep-quantized-weights needs a CUDA device"):
        load_model(path, keep_quantized_weights=True)


@pytest.mark.slow
def test_default_model_kept_quantized_gives_the_dequantized_models_tokens(smollm2_path, smollm2):
    """SmolLM2-135M (Q4_1; embeddings Q8_0, tied) in the interpreter: the greedy token of a one-token prompt
    (one decode-sized forward, gemv in every projection and the output layer: about 18 s on the 2-core CI
    machine, which is why there is one; its attention reads the V the kept weights wrote) against the
    dequantized model, logits compared. Longer runs through every type: the tiny model above."""
    quantized, runner_quantized = make_runner(smollm2_path, num_blocks=1, keep_quantized_weights=True)
    assert set(quantized_modules(quantized.model).values()) == {"Q4_1", "Q8_0"}
    runner_dequantized = make_runner(smollm2, num_blocks=1)[1]
    logits, reference = [], []
    tokens = greedy_paged(runner_quantized, [1], 1, [0], logits)
    assert tokens == greedy_paged(runner_dequantized, [1], 1, [0], reference)
    logits, reference = torch.cat(logits), torch.cat(reference)
    assert (logits - reference).abs().max() <= 1e-4 * reference.abs().max()


def engine_tokens(model, prompts: list[list[int]]) -> tuple[list[list[int]], object]:
    """Greedy tokens of `prompts` through an LLMEngine (attention backend auto), and the engine."""
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from localserve.engine.sampling_params import SamplingParams

    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_model_len=512))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs = engine.run_to_completion()
    return [outputs[i].token_ids for i in ids], engine


@pytest.mark.gpu
def test_every_type_on_cuda_kept_by_default_and_replayed_from_cuda_graphs(tmp_path):
    """On CUDA, fp32: blocks kept by default; the engine (Triton attention, decode steps from captured CUDA
    graphs; prompts of 1, 9 and 150 tokens reach gemv, fused and scratch) gives the dequantized model's
    greedy tokens."""
    arch, tied, weight_types = VARIANTS["qwen2-untied"]
    path = tmp_path / "every-type.gguf"
    write_random_gguf(path, arch, weight_types, tied)
    quantized = load_model(path, dtype=torch.float32, device="cuda")
    assert len(quantized_modules(quantized.model)) == len(weight_types) - 1  # all but the F16 layer
    dequantized = load_model(path, dtype=torch.float32, device="cuda", keep_quantized_weights=False)
    prompts = [[1], list(range(3, 12)), [(7 * i) % 250 + 3 for i in range(150)]]
    tokens, engine = engine_tokens(quantized.model, prompts)
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.graphs
    assert tokens == engine_tokens(dequantized.model, prompts)[0]


@pytest.mark.gpu
@pytest.mark.slow
def test_default_model_on_cuda_kept_quantized_gives_the_dequantized_models_tokens(smollm2_path):
    """SmolLM2 in fp32 on CUDA, blocks kept (by default there): a quarter of the dequantized model's memory,
    the same greedy tokens."""
    quantized = load_model(smollm2_path, dtype=torch.float32, device="cuda")
    dequantized = load_model(smollm2_path, dtype=torch.float32, device="cuda", keep_quantized_weights=False)

    def weight_bytes(model) -> int:
        return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))

    assert weight_bytes(quantized.model) < weight_bytes(dequantized.model) / 4
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 1953, 30], list(range(100, 260))]
    assert engine_tokens(quantized.model, prompts)[0] == engine_tokens(dequantized.model, prompts)[0]
