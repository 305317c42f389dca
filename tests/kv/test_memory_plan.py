"""Memory planning: bytes per token per format, blocks for a budget, and `localserve plan`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from localserve.cli import main
from localserve.kv import memory_plan
from localserve.kv.formats import KVFormatSpec
from localserve.kv.memory_plan import human_size, kv_budget_bytes, num_kv_blocks, parse_size
from localserve.loading.plan_model import estimated_weight_bytes, load_plan_model

LLAMA31_8B = Path(__file__).parents[1] / "helpers" / "llama31_8b_config.json"
GIB = 2 ** 30


# The memory plan takes parsed formats; these take their names.
def bits_per_value(name: str, head_dim: int) -> float:
    return KVFormatSpec.parse(name).bits_per_value(head_dim)


def kv_bytes_per_token(config, k_type: str, v_type: str) -> int:
    return memory_plan.kv_bytes_per_token(config, KVFormatSpec.parse(k_type), KVFormatSpec.parse(v_type))


def blocks_for_device(config, k_type: str, v_type: str, *args, **kwargs) -> int:
    return memory_plan.blocks_for_device(config, KVFormatSpec.parse(k_type), KVFormatSpec.parse(v_type), *args,
                                         **kwargs)


def plan(config, kv_budget: int, block_size: int, formats: tuple[tuple[str, str], ...]) -> list[memory_plan.PlanRow]:
    return memory_plan.plan(config, kv_budget, block_size,
                            tuple((KVFormatSpec.parse(k), KVFormatSpec.parse(v)) for k, v in formats))


def test_parse_size():
    assert parse_size("24GB") == parse_size("24GiB") == parse_size("24g") == 24 * GIB
    assert parse_size("512MB") == 512 * 2 ** 20 and parse_size("1e9") == 10 ** 9
    with pytest.raises(ValueError):
        parse_size("lots")


def test_llama31_8b_shapes_and_weights():
    config, weights, _ = load_plan_model(str(LLAMA31_8B))
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (32, 8, 128)
    assert 8.02e9 < weights / 2 < 8.04e9  # 8.03B parameters in bf16
    assert weights == estimated_weight_bytes(config)


@pytest.mark.parametrize("k_type,v_type", [("fp16", "fp16"), ("q8_0", "q8_0"), ("q4_rot", "q4_rot"),
                                           ("q8_0", "q4_rot"), ("fp32", "bf16")])
def test_bytes_per_token_match_bits_formula(k_type, v_type):
    config, _, _ = load_plan_model(str(LLAMA31_8B))
    values_per_token = config.num_layers * config.num_kv_heads * config.head_dim  # per K or V
    expected = values_per_token * (bits_per_value(k_type, 128) + bits_per_value(v_type, 128)) / 8
    assert kv_bytes_per_token(config, k_type, v_type) == expected
    assert kv_bytes_per_token(config, "fp16", "fp16") == config.kv_bytes_per_token_fp16 == 128 * 1024
    # Tokens per GiB follow: GiB / bytes per token.
    rows = plan(config, GIB, block_size=1, formats=((k_type, v_type),))
    assert rows[0].tokens == GIB // expected


def test_blocks_from_budget_and_utilization():
    config, weights, _ = load_plan_model(str(LLAMA31_8B))
    per_token = kv_bytes_per_token(config, "q8_0", "q8_0")
    assert num_kv_blocks(100 * per_token * 16 + 5, per_token, 16) == 100
    assert blocks_for_device(config, "q8_0", "q8_0", 16, weights, kv_budget=100 * per_token * 16) == 100
    budget = kv_budget_bytes(24 * GIB, weights, 0.9)
    assert budget == int(24 * GIB * 0.9) - weights
    blocks = blocks_for_device(config, "q8_0", "q8_0", 16, weights, total_memory=24 * GIB)
    assert blocks == budget // (per_token * 16)
    assert kv_budget_bytes(8 * GIB, weights, 0.9) == 0  # the weights alone do not fit
    with pytest.raises(ValueError):
        kv_budget_bytes(24 * GIB, weights, 1.5)


def test_plan_llama31_8b_on_24gb(capsys):
    assert main(["plan", "-m", str(LLAMA31_8B), "--vram", "24GB"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[1:-1] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| format")}
    tokens = {label: int(cells[3].strip().replace(",", "")) for label, cells in rows.items()}
    assert tokens["q8_0"] >= 1.88 * tokens["fp16"]
    assert tokens["q4_rot"] >= 3.76 * tokens["fp16"]
    # 24 GiB x 0.9 less 16.06 GB of weights leaves ~6.6 GiB: ~54K tokens at 128 KiB per token.
    assert 50_000 < tokens["fp16"] < 58_000
    seqs_8k = {label: int(cells[5]) for label, cells in rows.items()}
    assert seqs_8k["fp16"] == tokens["fp16"] // 8192 and seqs_8k["q4_rot"] >= 3 * seqs_8k["fp16"]


def test_plan_with_explicit_budget_and_missing_model(capsys, tmp_path):
    assert main(["plan", "-m", str(LLAMA31_8B), "--kv-budget", "7GiB"]) == 0
    assert "KV budget 7.0 GiB" in capsys.readouterr().out
    assert main(["plan", "-m", str(tmp_path / "nope.json")]) == 2
    assert main(["plan", "-m", str(LLAMA31_8B), "--vram", "8GB"]) == 1  # no room left for a pool


def test_engine_sizes_its_pool_from_a_byte_budget(tiny_model_dir):
    import torch

    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from localserve.loading.hf import load_model

    folder, _ = tiny_model_dir("llama")
    model = load_model(folder, dtype=torch.float32).model
    per_token = kv_bytes_per_token(model.config, "bf16", "fp32")
    engine = build_engine(model, None, EngineConfig(block_size=16, cache_type_k="bf16", cache_type_v="fp32",
                                                 kv_cache_memory_bytes=37 * 16 * per_token + 100))
    assert engine.block_manager.num_blocks == engine.runner.kv_cache.num_blocks == 37
    assert engine.runner.kv_cache.bytes_per_token() == per_token
    with pytest.raises(ValueError, match="CUDA"):
        build_engine(model, None, EngineConfig(gpu_memory_utilization=0.5))


def test_plan_counts_a_q4_k_m_gguf_at_its_stored_size(capsys, tmp_path):
    """A Q4_K_M-style mix (Q4_K, with Q6_K in attn_v, ffn_down and the output layer): `plan` counts the
    kept tensors at their stored bytes (sizes from gguf's own table) and the rest at 2 bytes a value."""
    import gguf

    from tests.helpers.gguf import write_random_gguf

    mix = {"token_embd": "Q4_K", "output": "Q6_K"}
    for layer in range(2):
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            mix[f"blk.{layer}.{name}"] = "Q4_K"
        mix[f"blk.{layer}.attn_v"] = mix[f"blk.{layer}.ffn_down"] = "Q6_K"
    path = tmp_path / "mixed-Q4_K_M.gguf"
    write_random_gguf(path, "llama", mix, tied=False)
    stored = dense = 0
    for tensor in gguf.GGUFReader(path).tensors:
        values = int(np.prod(tensor.shape))
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        stored += values // block_values * block_bytes if tensor.name[:-len(".weight")] in mix else 2 * values
        dense += 2 * values
    assert stored < dense / 3

    config, weights, source = load_plan_model(str(path))
    assert weights == stored and "stored size" in source
    assert main(["plan", "-m", str(path), "--vram", "24GB"]) == 0
    out = capsys.readouterr().out
    assert f"weights {human_size(stored)} (stored size, quantized blocks kept; {human_size(dense)}" in out
    budget = kv_budget_bytes(24 * GIB, stored, 0.9)
    fp16_tokens = budget // (kv_bytes_per_token(config, "fp16", "fp16") * 16) * 16
    assert f"| fp16 | 16, 16 | {kv_bytes_per_token(config, 'fp16', 'fp16'):,}" in out and f"{fp16_tokens:,}" in out
    assert main(["plan", "-m", str(path), "--vram", "24GB", "--no-keep-quantized-weights"]) == 0
    assert f"weights {human_size(dense)} (parameters x 2 bytes)" in capsys.readouterr().out


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json, the fields that shape it
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def test_a_mixture_of_experts_counts_every_expert_resident(tmp_path):
    from localserve.loading.model_card import parameter_count

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_30B_A3B))
    config, weights, _ = load_plan_model(str(path))
    assert 30.4e9 < parameter_count(config) < 30.6e9  # Qwen's 30.5B total, 3.3B activated
    assert 3.2e9 < parameter_count(config, active=True) < 3.4e9
    assert weights == 2 * parameter_count(config)
    assert kv_bytes_per_token(config, "fp16", "fp16") == 48 * 4 * 128 * 2 * 2
