"""The capacity plan of models with window layers: each window group's pool is bounded (its slots' windows
and one prefill chunk each), the full group takes the rest, and "tokens that fit" shows it. On gpt-oss-20b
(24 layers alternating a 128-token window with full attention) and Gemma 3 27B (62 layers, every 6th
global, the others a 1,024-token window), from their public config.json values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from localserve.models.config import LayerAttention, ModelConfig

from localserve.cli import main
from localserve.kv.formats import KVFormatSpec
from localserve.kv.group_plan import plan_group_pools, state_pool_slots, window_pool_blocks
from localserve.kv.layer_groups import RECURRENT
from localserve.kv.memory_plan import kv_bytes_per_token, plan
from localserve.kv.state_shape import StateShape

HELPERS = Path(__file__).parents[1] / "helpers"
GPT_OSS_20B = HELPERS / "gpt_oss_20b_config.json"
GEMMA3_27B = HELPERS / "gemma3_27b_config.json"
GIB = 2 ** 30
FP16 = KVFormatSpec.parse("fp16")


def layered_config(path: Path) -> ModelConfig:
    """The config's KV shapes read here, independently of the families: transformers' rule for which layers
    slide (`layer_types`, else every `sliding_window_pattern`-th layer is global)."""
    raw = json.loads(path.read_text())
    text = raw.get("text_config", raw)
    num_layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types") or [
        "full_attention" if (layer + 1) % text["sliding_window_pattern"] == 0 else "sliding_attention"
        for layer in range(num_layers)]
    layers = tuple(LayerAttention(text["num_key_value_heads"], text["head_dim"],
                                  text["sliding_window"] if kind == "sliding_attention" else None)
                   for kind in layer_types)
    return ModelConfig(architecture=raw["architectures"][0], vocab_size=text["vocab_size"],
                       hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
                       num_layers=num_layers, num_heads=text["num_attention_heads"],
                       num_kv_heads=text["num_key_value_heads"], head_dim=text["head_dim"],
                       max_position_embeddings=text["max_position_embeddings"], layer_attention=layers)


@pytest.mark.parametrize("path, window, num_window_layers, num_full_layers, budget, window_blocks", [
    # 16 slots x (ceil((128 + 512 - 1) / 16) + 1) = 16 x 41
    (GPT_OSS_20B, 128, 12, 12, 8 * GIB, 656),
    # 16 slots x (ceil((1024 + 512 - 1) / 16) + 1) = 16 x 97
    (GEMMA3_27B, 1024, 52, 10, 16 * GIB, 1552),
])
def test_window_pools_are_bounded_and_the_full_layers_take_the_rest(path, window, num_window_layers,
                                                                    num_full_layers, budget, window_blocks):
    config = layered_config(path)
    per_layer = config.num_kv_heads * config.head_dim * 2 * 2  # K and V, 2 bytes a value
    full, windowed = plan_group_pools(config, FP16, FP16, budget, 16, 16, config.context_length, 512)
    assert (full.group.sliding_window, len(full.group.layers)) == (None, num_full_layers)
    assert (windowed.group.sliding_window, len(windowed.group.layers)) == (window, num_window_layers)
    assert windowed.num_blocks == window_blocks == window_pool_blocks(window, 16, 16, config.context_length, 512)
    window_bytes = window_blocks * 16 * num_window_layers * per_layer
    assert full.num_blocks == (budget - window_bytes) // (16 * num_full_layers * per_layer)

    [row] = plan(config, budget, 16, formats=((FP16, FP16),))
    all_layers = (num_window_layers + num_full_layers) * per_layer
    assert row.bytes_per_token == all_layers
    assert row.tokens == full.num_blocks * 16
    assert row.tokens_without_windows == budget // (16 * all_layers) * 16
    assert row.tokens > 1.9 * row.tokens_without_windows  # what bounded window layers buy
    assert row.sequences[32768] == row.tokens // 32768


def test_a_window_pool_wanting_more_than_the_full_pool_is_held_to_its_size():
    config = layered_config(GEMMA3_27B)
    full, windowed = plan_group_pools(config, FP16, FP16, 4 * GIB, 16, 64, config.context_length, 512)
    assert windowed.num_blocks == full.num_blocks  # 64 slots of 1,024-token windows do not fit 4 GiB
    assert full.num_blocks == 4 * GIB // (16 * 62 * 16 * 128 * 4)


def test_without_chunked_prefill_a_window_pool_also_holds_one_longest_prompt():
    assert window_pool_blocks(128, 16, 16, 32768, None) == 16 * 9 + 2048


def test_plan_prints_the_window_pools_beside_the_tokens_that_fit(capsys, tmp_path):
    from localserve.models.registry import config_from_hf

    for path in (GPT_OSS_20B, GEMMA3_27B):
        try:
            config_from_hf(json.loads(path.read_text()), name=path.stem, source=str(path))
        except ValueError:
            pytest.skip(f"{path.name}: its family is not on this branch yet (gpt-oss, Gemma 3)")
    folder = tmp_path / "gpt-oss-20b"
    folder.mkdir()
    (folder / "config.json").write_text(GPT_OSS_20B.read_text())
    assert main(["plan", "-m", str(folder), "--kv-budget", "8GB"]) == 0
    out = capsys.readouterr().out
    assert "layer groups: full (12 layers) and window 128 (12 layers)" in out
    assert "| 339,024 |" in out and "window 128 (12 layers): 656 blocks, 246.0 MiB" in out


def test_plan_of_a_qwen2_with_window_layers_shows_its_groups(capsys, tmp_path):
    """The command end to end on a family this branch reads: Qwen2 with `layer_types`."""
    folder = tmp_path / "qwen2-windows"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "use_sliding_window": True, "sliding_window": 4096,
        "layer_types": ["sliding_attention" if layer % 2 else "full_attention" for layer in range(28)]}))
    assert main(["plan", "-m", str(folder), "--kv-budget", "4GB", "-np", "8"]) == 0
    out = capsys.readouterr().out
    per_layer = 4 * 128 * 2 * 2
    window_blocks = 8 * (-(-(4096 + 511) // 16) + 1)
    full_blocks = (4 * GIB - window_blocks * 16 * 14 * per_layer) // (16 * 14 * per_layer)
    assert "layer groups: full (14 layers) and window 4096 (14 layers)" in out
    assert f"| {full_blocks * 16:,} |" in out and f"window 4096 (14 layers): {window_blocks:,} blocks" in out


def test_plan_counts_a_folders_mxfp4_experts_at_their_stored_size(capsys, tmp_path):
    """gpt-oss-20b's config.json says `quant_method: mxfp4`: the server keeps those experts in their blocks
    (17 bytes per 32 values), so the plan counts them so, and a 24 GB card holds the model and a pool; with
    --no-keep-quantized-weights every parameter counts at 2 bytes and nothing is left for the pool."""
    from localserve.loading.model_card import parameter_count
    from localserve.loading.plan_model import load_plan_model

    folder = tmp_path / "gpt-oss-20b"
    folder.mkdir()
    (folder / "config.json").write_text(GPT_OSS_20B.read_text())
    raw = json.loads(GPT_OSS_20B.read_text())
    experts = raw["num_hidden_layers"] * raw["num_local_experts"] * 3 * raw["hidden_size"] * raw["intermediate_size"]
    config, kept, how = load_plan_model(str(folder))
    assert kept == int((parameter_count(config) - experts) * 2 + experts * 17 / 32)
    assert 12 * GIB < kept < 13.5 * GIB and "MXFP4" in how
    dense_config, dense, _ = load_plan_model(str(folder), keep_quantized_weights=False)
    assert dense == parameter_count(dense_config) * 2
    assert main(["plan", "-m", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "no room for a KV pool" not in out and "window 128 (12 layers)" in out
    assert main(["plan", "-m", str(folder), "--no-keep-quantized-weights"]) == 1
    assert "no room for a KV pool" in capsys.readouterr().out


# ---- the state group (recurrent layers) ----
STATE = StateShape(conv_dim=64, conv_width=4, num_heads=4, key_dim=16, value_dim=16)
SLOT_BYTES = 6 * (64 * 3 * 2 + 4 * 16 * 16 * 4)  # 6 recurrent layers: conv inputs in 16 bits, matrices in float32


def hybrid_config(windows: tuple[int | None, ...] = (None, None)) -> ModelConfig:
    """8 layers: every 4th attends (with `windows[i]` for the i-th of them), the others are recurrent."""
    attending = iter(windows)
    layers = tuple(LayerAttention(2, 32, next(attending)) if layer % 4 == 3 else LayerAttention(2, 32, state=STATE)
                   for layer in range(8))
    return ModelConfig(architecture="Hybrid", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=8,
                       num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096, layer_attention=layers)


@pytest.mark.parametrize("chunk_tokens, max_model_len, checkpoint_blocks, slots", [
    (64, 4096, 2, 4 * 2 + 2 + 1 + 4),  # 64-token chunks hold two 32-token checkpoint spans
    (65, 4096, 2, 4 * 2 + 3 + 1 + 4),  # one token more: a third
    (None, 1024, 2, 4 * 2 + 32 + 1 + 4),  # no chunked prefill: the longest prompt's checkpoints
    (None, 1025, 2, 4 * 2 + 33 + 1 + 4),
    (64, 4096, 1, 4 * 2 + 4 + 1 + 4),
])
def test_state_pool_slots_follow_the_rule(chunk_tokens, max_model_len, checkpoint_blocks, slots):
    assert state_pool_slots(16, 4, max_model_len, chunk_tokens, checkpoint_blocks, 4) == slots
    with pytest.raises(ValueError, match="state checkpoint blocks >= 1"):
        state_pool_slots(16, 4, max_model_len, chunk_tokens, 0)


def test_the_state_pool_comes_off_the_budget_first_and_the_full_group_takes_the_rest():
    budget = 2 ** 20
    full, state = plan_group_pools(hybrid_config(), FP16, FP16, budget, 16, 4, 4096, 64, state_checkpoint_blocks=2,
                                   state_cache_slots=4)
    assert (full.group.layers, full.label, full.bytes_per_token) == ((3, 7), "full", 2 * 2 * 32 * 2 * 2)
    assert (state.group.layers, state.label, state.group.recurrent) == ((0, 1, 2, 4, 5, 6), "state", True)
    assert (state.bytes_per_token, state.slot_bytes, state.num_blocks) == (0, SLOT_BYTES, 15)
    assert full.num_blocks == (budget - 15 * SLOT_BYTES) // (16 * full.bytes_per_token) == 78
    assert state.pool_bytes(16) == 15 * SLOT_BYTES and full.pool_bytes(16) == 78 * 16 * 512


@pytest.mark.parametrize("short_by", [0, 1])
def test_a_budget_short_of_the_state_pool_is_refused_naming_the_shortfall(short_by):
    budget = 15 * SLOT_BYTES - short_by
    args = (hybrid_config(), FP16, FP16, budget, 16, 4, 4096, 64)
    if not short_by:
        full, state = plan_group_pools(*args, state_checkpoint_blocks=2, state_cache_slots=4)
        assert (full.num_blocks, state.num_blocks) == (0, 15)
        return
    with pytest.raises(ValueError, match=f"15 slots of {SLOT_BYTES:,} bytes.*: 1 bytes .* more than the KV budget"
                                         ".* lower -np"):
        plan_group_pools(*args, state_checkpoint_blocks=2, state_cache_slots=4)


def test_without_a_budget_the_plan_gives_the_groups_and_the_state_pool():
    full, windowed, state = plan_group_pools(hybrid_config((None, 64)), FP16, FP16, None, 16, 4, 4096, 64,
                                             state_checkpoint_blocks=4)
    assert [pool.label for pool in (full, windowed, state)] == ["full", "window 64", "state"]
    # The KV groups get nothing (a window pool is held to the full group's size), the state pool its rule's.
    assert (full.num_blocks, windowed.num_blocks, state.num_blocks) == (0, 0, 4 * 2 + 1 + 1)
    assert [pool.group.group_window for pool in (full, windowed, state)] == [None, 64, RECURRENT]


def test_a_model_of_recurrent_layers_only_has_the_state_pool():
    layers = tuple(LayerAttention(2, 32, state=STATE) for _ in range(3))
    config = ModelConfig(architecture="Recurrent", vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096,
                         layer_attention=layers)
    [state] = plan_group_pools(config, FP16, FP16, 2 ** 30, 16, 2, 4096, 32)
    assert (state.label, state.num_blocks, state.slot_bytes) == ("state", 2 * 2 + 2 + 1, SLOT_BYTES // 2)


def test_recurrent_layers_keep_no_kv_per_token():
    assert kv_bytes_per_token(hybrid_config(), FP16, FP16) == 2 * 2 * 32 * 2 * 2  # the two attending layers
