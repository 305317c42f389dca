"""`localserve plan` on hybrid linear-attention models (issue 37): the released Qwen3.6-35B-A3B and
Qwen3.6-27B configs, their recurrent states' share of a 24 GB card beside the attention layers' KV, and the
tokens that fit per KV format. Every figure is recomputed here from the configs' shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from localserve.models.registry import config_from_hf

from localserve.cli import main
from localserve.kv import memory_plan
from localserve.kv.formats import KVFormatSpec
from localserve.kv.group_plan import state_pool_slots

HELPERS = Path(__file__).parents[1] / "helpers"
MODELS = {  # config file, weights as a Q4 GGUF of it takes, linear layers, attention layers
    "35b": (HELPERS / "qwen3_6_35b_a3b_config.json", "19GB", 30, 10),
    "27b": (HELPERS / "qwen3_6_27b_config.json", "16.5GB", 48, 16),
}
GIB = 2 ** 30


def text_shapes(path: Path) -> dict:
    return json.loads(path.read_text())["text_config"]


def state_bytes(text: dict, num_linear: int) -> int:
    """One state of every linear layer: conv inputs (bf16) of q, k and v over kernel - 1 steps, and one
    float32 [key dim, value dim] matrix per value head."""
    k_heads, v_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    k_dim, v_dim = text["linear_key_head_dim"], text["linear_value_head_dim"]
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * (text["linear_conv_kernel_dim"] - 1) * 2
    return num_linear * (conv + v_heads * k_dim * v_dim * 4)


def kv_bytes_per_token(text: dict, num_attention: int, bits: float) -> int:
    return int(num_attention * text["num_key_value_heads"] * text["head_dim"] * 2 * bits / 8)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_plan_shows_the_states_share_and_the_tokens_that_fit(name, capsys):
    path, weights, num_linear, num_attention = MODELS[name]
    text = text_shapes(path)
    assert main(["plan", "-m", str(path), "--weights", weights, "-np", "4"]) == 0
    out = capsys.readouterr().out
    one_state = state_bytes(text, num_linear)
    budget = int(24 * GIB * 0.9) - int(float(weights[:-2]) * GIB)
    slots = state_pool_slots(16, 4, text["max_position_embeddings"], 512, 512 // 16, 4)
    pool = slots * one_state
    fp16 = kv_bytes_per_token(text, num_attention, 16)
    line = next(line for line in out.splitlines() if line.startswith("recurrent states"))
    assert f"({num_linear} of {num_linear + num_attention} layers)" in line
    assert f"{memory_plan.human_size(one_state)} = {one_state // fp16:,} tokens of fp16 KV" in line
    assert f"state pool {slots:,} slots = {memory_plan.human_size(pool)} ({pool / budget:.0%} of the pool)" in line
    rows = {cells[0].strip(): cells for cells in (line.split("|")[1:-1] for line in out.splitlines()
                                                  if line.startswith("| ") and not line.startswith("| format"))}
    for label, bits in (("fp16", 16), ("q8_0", 8.5), ("q4_rot:-mean,-key_transform", 4.0625)):
        per_token = kv_bytes_per_token(text, num_attention, bits)
        assert int(rows[label][2].split()[0].replace(",", "")) == per_token
        assert int(rows[label][3].replace(",", "")) == (budget - pool) // (per_token * 16) * 16


def test_published_state_sizes():
    """What one checkpoint costs per sequence (the issue asks it said): 61.4 MiB for 35B-A3B, 146.8 MiB for 27B."""
    assert state_bytes(text_shapes(MODELS["35b"][0]), 30) == 64_389_120
    assert state_bytes(text_shapes(MODELS["27b"][0]), 48) == 153_944_064
    for name, (path, _, num_linear, _) in MODELS.items():
        config = config_from_hf(json.loads(path.read_text()), name=name, source=str(path))
        rows = memory_plan.plan(config, 8 * GIB, formats=((KVFormatSpec.parse("fp16"),) * 2,), max_num_seqs=1)
        assert rows[0].state_pool.slot_bytes == state_bytes(text_shapes(path), num_linear)


def test_a_budget_that_cannot_hold_the_state_pool_is_refused_naming_the_shortfall(capsys):
    path = MODELS["27b"][0]
    assert main(["plan", "-m", str(path), "--kv-budget", "1GB", "-np", "4"]) == 1
    out = capsys.readouterr().out
    assert "recurrent state pool needs" in out and "more than the KV budget" in out and "fewer sequences" in out


def test_a_checkpoint_spacing_off_the_blocks_is_refused(capsys):
    assert main(["plan", "-m", str(MODELS["35b"][0]), "--state-checkpoint-tokens", "100"]) == 2
    assert "multiple of --block-size 16" in capsys.readouterr().out


def test_the_plan_without_recurrent_layers_prints_no_state_line(capsys):
    assert main(["plan", "-m", str(HELPERS / "llama31_8b_config.json")]) == 0
    assert "recurrent states" not in capsys.readouterr().out


@pytest.mark.parametrize("name", list(MODELS))
def test_without_np_the_plan_runs_the_sequences_the_server_would(name, capsys):
    """The server lowers its default 16 sequences where their states would take over half the KV pool; the
    plan shows the same: the most n whose pool, 2n + ceil(chunk / spacing) + 1 slots and n cache slots,
    fits in half the budget."""
    path, weights, num_linear, _ = MODELS[name]
    one_state = state_bytes(text_shapes(path), num_linear)
    budget = int(24 * GIB * 0.9) - int(float(weights[:-2]) * GIB)
    expected = max(n for n in range(1, 17) if (3 * n + 2) * one_state <= budget / 2)
    assert expected < 16
    assert main(["plan", "-m", str(path), "--weights", weights]) == 0
    out = capsys.readouterr().out
    assert f"-np not given: {expected} sequences" in out
    assert f"state pool {3 * expected + 2:,} slots" in out
