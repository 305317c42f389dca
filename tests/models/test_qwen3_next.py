"""Qwen3-Next and Qwen3.5-MoE (hybrid models with a mixture of experts and a gated shared expert) against
transformers on the same random weights (tests/helpers/hybrid_models.py): one pass, a prompt prefilled in
chunks off the 16-token blocks with a save point inside one (the saved state is the prefix's own);
Qwen3-Next's fused projections kept as stored, its dense layers (`mlp_only_layers`) where it says."""

from __future__ import annotations

import pytest
import torch
from localserve.models.layers.mlp import GatedMLP
from localserve.models.layers.moe import MoE

from localserve.loading.hf import load_model
from tests.helpers.hybrid_models import (
    VOCAB,
    Chunk,
    HybridDriver,
    assert_close_logits,
    qwen3_5_moe_config,
    qwen3_next_config,
    save_hybrid,
    transformers_logits,
)

PROMPT = torch.randint(3, VOCAB, (41,), generator=torch.Generator().manual_seed(11)).tolist()
TABLE = [3, 0, 5]
CONFIGS = {"qwen3_next": qwen3_next_config, "qwen3_5_moe": qwen3_5_moe_config}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = save_hybrid(folder, CONFIGS[request.param]())
    return request.param, load_model(folder, dtype=torch.float32), transformers_logits(hf_model, PROMPT)


def test_layers_as_the_config_says(model):
    family, loaded, _ = model
    config, layers = loaded.config, loaded.model.model.layers
    assert config.family == family and config.recurrent_layers == (0, 1, 3)
    assert config.moe.shared_expert_gate and config.moe.shared_intermediate_size == 48 and config.moe.normalize
    fused = family == "qwen3_next"
    assert config.linear_attention.fused_qkvz == config.linear_attention.fused_ba == fused
    assert all(hasattr(layers[i].linear_attn, "in_proj_qkvz") == fused for i in config.recurrent_layers)
    dense = [1] if family == "qwen3_next" else []
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, GatedMLP)] == dense
    assert all(isinstance(layer.mlp, MoE) for i, layer in enumerate(layers) if i not in dense)


def test_one_pass_matches_transformers(model):
    _, loaded, theirs = model
    assert_close_logits(HybridDriver(loaded.model).prefill_in_pieces(PROMPT, [], TABLE), theirs)


def test_chunks_and_a_save_point_inside_one(model):
    """Chunks of 19 and 22 tokens, the first saving after 7 too: the logits are transformers', and the
    state saved after 7 is what 7 tokens alone leave."""
    _, loaded, theirs = model
    driver = HybridDriver(loaded.model)
    first = driver.step([Chunk(PROMPT[:19], 0, -1, [(7, 2), (19, 0)], TABLE)])
    second = driver.step([Chunk(PROMPT[19:], 19, 0, [(22, 0)], TABLE)])
    assert_close_logits(torch.cat([first, second]), theirs)
    alone = HybridDriver(loaded.model)
    alone.step([Chunk(PROMPT[:7], 0, -1, [(7, 1)], TABLE)])
    for layer in loaded.config.recurrent_layers:
        for saved, own in zip(driver.state(layer, 2), alone.state(layer, 1)):
            torch.testing.assert_close(saved, own, rtol=1e-4, atol=2e-5)


def test_stacked_experts_and_mtp_tensors(model, tmp_path):
    """The same weights with the experts stacked as transformers 5 stores them (`gate_up_proj` [E, 2I, H],
    gate rows first; `down_proj` [E, H, I]) and multi-token prediction tensors beside (`mtp.*`, as the
    released checkpoints carry; skipped, and said so): the same logits."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    family, loaded, theirs = model
    tensors = load_file(loaded.path / "model.safetensors")
    stacked = {}
    for layer in range(loaded.config.num_layers):
        stem = f"model.layers.{layer}.mlp.experts"
        parts = {p: [tensors.pop(f"{stem}.{e}.{p}_proj.weight") for e in range(4)
                     if f"{stem}.{e}.{p}_proj.weight" in tensors] for p in ("gate", "up", "down")}
        if parts["gate"]:
            stacked[f"{stem}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(parts["gate"], parts["up"])])
            stacked[f"{stem}.down_proj"] = torch.stack(parts["down"])
    stacked["mtp.fc.weight"] = torch.ones(4, 4)
    save_file(tensors | stacked, tmp_path / "model.safetensors")
    config = json.loads((loaded.path / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(loaded.path / "generation_config.json", tmp_path)
    restacked = load_model(tmp_path, dtype=torch.float32)
    assert restacked.config.unloaded_parts == ("multi-token prediction layers",)
    assert_close_logits(HybridDriver(restacked.model).prefill_in_pieces(PROMPT, [13], TABLE), theirs)
