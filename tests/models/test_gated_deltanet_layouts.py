"""The Gated DeltaNet layouts other than Hugging Face's (LinearAttentionConfig's switches), as llama.cpp's
converter rewrites the tensors for its GGUFs: a Qwen3.5 model with its value heads tiled, `A` stored as
-exp(A_log) and its norms' 1 added in; a Qwen3-Next model with q, k, v and z unfused but b and a kept
fused. Each, built from the rewritten tensors, gives the Hugging Face layout's logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from localserve.models.layers.hybrid import HybridForCausalLM

from localserve.loading.hf import load_model
from tests.helpers.hybrid_models import (
    VOCAB,
    HybridDriver,
    assert_close_logits,
    qwen3_5_config,
    qwen3_next_config,
    save_hybrid,
)

PROMPT = torch.randint(3, VOCAB, (37,), generator=torch.Generator().manual_seed(3)).tolist()
TABLE = [2, 0, 1]


def tile(tensor: torch.Tensor, k_heads: int, head_dim: int, dim: int = 0) -> torch.Tensor:
    """Value heads along `dim` from grouped (key head by key head) to tiled order (j -> key head j % Hk)."""
    moved = tensor.movedim(dim, 0)
    grouped = moved.reshape(k_heads, -1, head_dim, *moved.shape[1:])
    return grouped.transpose(0, 1).reshape(moved.shape).movedim(0, dim)


def rebuild(loaded, linear_changes: dict, rewrite) -> HybridForCausalLM:
    """A model of `loaded`'s config with `linear_changes`, its weights `loaded`'s rewritten by `rewrite`."""
    config = loaded.config
    config = dataclasses.replace(config, linear_attention=dataclasses.replace(config.linear_attention,
                                                                              **linear_changes))
    model = HybridForCausalLM(config)
    model.load_state_dict(rewrite(dict(loaded.model.state_dict()), config))
    return model.eval()


def llama_cpp_qwen35(state: dict, config) -> dict:
    """What llama.cpp's converter does to a Qwen3.5 checkpoint's tensors (value heads tiled, A, norms + 1)."""
    linear = config.linear_attention
    k_heads, v_dim = linear.num_key_heads, linear.value_head_dim
    out = {}
    for name, tensor in state.items():
        if ".linear_attn." in name:
            part = name.split(".linear_attn.")[1]
            if part == "in_proj_qkv.weight" or part == "conv1d.weight":
                qk, v = tensor[:2 * linear.key_dim], tensor[2 * linear.key_dim:]
                tensor = torch.cat([qk, tile(v, k_heads, v_dim)])
            elif part == "in_proj_z.weight":
                tensor = tile(tensor, k_heads, v_dim)
            elif part in ("in_proj_a.weight", "in_proj_b.weight", "dt_bias"):
                tensor = tile(tensor, k_heads, 1)
            elif part == "A_log":
                name, tensor = name.replace("A_log", "A"), -tile(tensor, k_heads, 1).exp()
            elif part == "out_proj.weight":
                tensor = tile(tensor, k_heads, v_dim, dim=1)
        elif name.endswith("norm.weight"):
            tensor = tensor + 1
        out[name] = tensor
    return out


def llama_cpp_qwen3next(state: dict, config) -> dict:
    """What llama.cpp's converter does to Qwen3-Next's fused `in_proj_qkvz`: q, k, v apart from z, each in
    head order (`in_proj_ba` stays fused)."""
    linear = config.linear_attention
    group = linear.num_value_heads // linear.num_key_heads
    out = {}
    for name, tensor in state.items():
        if name.endswith("in_proj_qkvz.weight"):
            stem = name.removesuffix("qkvz.weight")
            per_head = tensor.view(linear.num_key_heads, -1, tensor.shape[-1])
            sizes = (linear.key_head_dim, linear.key_head_dim, group * linear.value_head_dim,
                     group * linear.value_head_dim)
            q, k, v, z = (part.reshape(-1, tensor.shape[-1]) for part in per_head.split(sizes, dim=1))
            out[stem + "qkv.weight"], out[stem + "z.weight"] = torch.cat([q, k, v]), z
        else:
            out[name] = tensor
    return out


@pytest.mark.parametrize(("make_config", "changes", "rewrite"), [
    (qwen3_5_config, dict(tiled_value_heads=True, log_decay_rate=False, norm_offset=0.0), llama_cpp_qwen35),
    (qwen3_next_config, dict(fused_qkvz=False), llama_cpp_qwen3next),
], ids=["qwen35-gguf-layout", "qwen3next-gguf-layout"])
def test_rewritten_layout_gives_the_same_logits(tmp_path, make_config, changes, rewrite):
    save_hybrid(tmp_path, make_config())
    loaded = load_model(tmp_path, dtype=torch.float32)
    want = HybridDriver(loaded.model).prefill_in_pieces(PROMPT, [20], TABLE)
    model = rebuild(loaded, changes, rewrite)
    assert_close_logits(HybridDriver(model).prefill_in_pieces(PROMPT, [20], TABLE), want)
    if changes.get("tiled_value_heads"):  # the reordering matters: grouped heads read tiled weights differ
        wrong = rebuild(loaded, changes | {"tiled_value_heads": False}, rewrite)
        assert (HybridDriver(wrong).prefill_in_pieces(PROMPT, [20], TABLE) - want).abs().max() > 0.1
