"""Gemma 3 against transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import make_runner, save_random_model

PROMPT = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
TABLE = [3, 0, 6, 2]


def tiny_config(**changes):
    import transformers

    return transformers.Gemma3TextConfig(**(dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=64, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 8.0},
        eos_token_id=1, bos_token_id=2, pad_token_id=0, max_position_embeddings=2048) | changes))


def test_probe(tmp_path, monkeypatch):
    from localserve.attention.base import AttentionGeometry
    monkeypatch.setattr(AttentionGeometry, "check_plain", lambda self, backend: None)
    hf = save_random_model(tmp_path, tiny_config())
    loaded, runner = make_runner(tmp_path)
    ours = runner.prompt_logits(PROMPT, TABLE)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    print((ours - theirs).abs().max(), theirs.abs().max())
    assert (ours - theirs).abs().max() < 1e-4


def tiny4(**changes):
    import transformers

    return transformers.Gemma4TextConfig(**(dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=64, final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        eos_token_id=1, bos_token_id=2, pad_token_id=0, max_position_embeddings=2048) | changes))


@pytest.mark.parametrize("moe", [False, True])
def test_probe4(tmp_path, monkeypatch, moe):
    from localserve.attention.base import AttentionGeometry
    monkeypatch.setattr(AttentionGeometry, "check_plain", lambda self, backend: None)
    hf = save_random_model(tmp_path, tiny4(enable_moe_block=moe, global_head_dim=16, num_global_key_value_heads=2))
    loaded, runner = make_runner(tmp_path)
    ours = runner.prompt_logits(PROMPT, TABLE)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    print((ours - theirs).abs().max(), theirs.abs().max())
    assert (ours - theirs).abs().max() < 1e-4
