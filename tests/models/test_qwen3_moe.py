"""Qwen3-MoE against transformers on the same random weights: from save_pretrained folders (one tensor per
expert, sharded; transformers 5's stacked experts), from a GGUF made by llama.cpp's own converter, from
that GGUF with gate and up fused and with its experts in quantized blocks; and what is refused."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from localserve.loading.gguf import GGUFLoadError
from localserve.loading.hf import ModelLoadError, load_model
from localserve.loading.plan_model import load_plan_model
from tests.helpers.gguf import random_blocks
from tests.helpers.gguf_convert import convert, rewrite_gguf, write_bpe_tokenizer
from tests.helpers.models import assert_matches_transformers, greedy_paged, make_runner, save_random_model

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPT = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(7)).tolist()
TABLE = [5, 1, 7, 3, 0, 6]


def tiny_config(**changes):
    import transformers

    # I = 256 so that the down projection's rows are whole K-quant blocks (256 values)
    return transformers.Qwen3MoeConfig(**(dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=256,
        norm_topk_prob=True, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
        | changes))


def assert_matches(runner, hf_model) -> None:
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """save_pretrained's folder: one tensor per expert (transformers 5 saves the original layout), in shards."""
    folder = tmp_path_factory.mktemp("qwen3moe")
    hf_model = save_random_model(folder, tiny_config(), max_shard_size="300KB")
    write_bpe_tokenizer(folder, 320, SPECIALS)
    return folder, hf_model


@pytest.fixture(scope="module")
def converted(sharded, tmp_path_factory):
    folder, _ = sharded
    return convert(folder, tmp_path_factory.mktemp("gguf") / "qwen3moe-f32.gguf", "--outtype", "f32",
                   pre_tokenizer="qwen2")


def test_sharded_checkpoint_with_one_tensor_per_expert(sharded):
    folder, hf_model = sharded
    names = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and len(set(names.values())) > 1
    loaded, runner = make_runner(folder)
    assert loaded.config.moe.num_experts == 8 and loaded.config.moe.normalize
    assert_matches(runner, hf_model)


def test_stacked_experts_of_transformers_5_with_weights_not_renormalised(tmp_path):
    hf_model = save_random_model(tmp_path / "saved", tiny_config(norm_topk_prob=False, mlp_only_layers=[0]), seed=3)
    folder = tmp_path / "stacked"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    state = hf_model.state_dict()
    assert tuple(state["model.layers.1.mlp.experts.gate_up_proj"].shape) == (8, 512, 64)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, folder / "model.safetensors")
    loaded, runner = make_runner(folder)
    assert not loaded.config.moe.normalize and loaded.config.moe.dense_layers == (0,)
    assert_matches(runner, hf_model)


def test_gguf_from_llama_cpp_converter(sharded, converted):
    loaded, runner = make_runner(converted)
    assert loaded.config.architecture == "Qwen3MoeForCausalLM" and loaded.config.moe.top_k == 3
    assert_matches(runner, sharded[1])


def test_gguf_with_gate_and_up_fused_is_the_same_model(converted, tmp_path):
    ups = {}

    def fuse(name, values):
        if ".ffn_gate_exps." in name or ".ffn_up_exps." in name:
            ups[name] = values
            if ".ffn_up_exps." not in name:
                return []
            gate = ups[name.replace("ffn_up_exps", "ffn_gate_exps")]
            return [(name.replace("ffn_up_exps", "ffn_gate_up_exps"), np.concatenate([gate, values], axis=1), Q.F32)]
        return None

    fused = rewrite_gguf(converted, tmp_path / "fused.gguf", fuse)
    assert any(t.name == "blk.0.ffn_gate_up_exps.weight" for t in gguf.GGUFReader(fused).tensors)
    _, runner = make_runner(fused)
    _, reference = make_runner(converted)
    assert torch.equal(runner.prompt_logits(PROMPT, TABLE), reference.prompt_logits(PROMPT, TABLE))


# Expert projections in quantized blocks: (layer, projection) -> type; rows of 64 values (gate, up) take
# 32-value blocks, rows of 256 (down) K-quant blocks.
EXPERT_TYPES = {(0, "gate"): "Q8_0", (0, "up"): "Q8_0", (0, "down"): "Q4_K", (1, "up"): "MXFP4", (1, "down"): "Q6_K"}


def quantize_experts(name: str, values: np.ndarray):
    parts = name.split(".")
    qtype = EXPERT_TYPES.get((int(parts[1]), parts[2].removeprefix("ffn_").removesuffix("_exps"))) \
        if parts[0] == "blk" and parts[2].endswith("_exps") else None
    if qtype is None:
        return None
    if qtype in ("Q8_0", "MXFP4"):
        return [(name, gguf.quants.quantize(values, Q[qtype]), Q[qtype])]
    # gguf-py cannot quantize K-quants: random valid blocks of that type instead
    experts, rows, columns = values.shape
    blocks = random_blocks(qtype, experts * rows, columns, seed=len(name), magnitude=0.2)
    return [(name, blocks.reshape(experts, rows, -1), Q[qtype])]


@pytest.fixture(scope="module")
def quantized(converted, tmp_path_factory):
    """The converted GGUF with its experts in the blocks of EXPERT_TYPES."""
    return rewrite_gguf(converted, tmp_path_factory.mktemp("quantized") / "quantized.gguf", quantize_experts)


def reference_with(hf_model, loaded):
    """hf_model given the expert weights localserve loaded (the dequantized blocks), all else unchanged."""
    import copy

    reference = copy.deepcopy(hf_model)
    ours = loaded.model.model.layers
    with torch.no_grad():
        for layer, theirs in zip(ours, reference.model.layers):
            experts = layer.mlp.experts
            theirs.mlp.experts.gate_up_proj.copy_(torch.cat([experts.gate_proj, experts.up_proj], dim=1))
            theirs.mlp.experts.down_proj.copy_(experts.down_proj)
    return reference


def test_gguf_with_quantized_experts_against_the_dequantized_model(sharded, quantized):
    path = quantized
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_K" and types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    loaded, runner = make_runner(path)
    for tensor in gguf.GGUFReader(path).tensors:  # each stack where its GGUF name says
        _, layer, kind, _ = (tensor.name.split(".") + ["", "", ""])[:4]
        if kind.endswith("_exps"):
            ours = getattr(loaded.model.model.layers[int(layer)].mlp.experts, kind[4:-5] + "_proj")
            reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
            assert torch.equal(ours, reference)
    assert_matches(runner, reference_with(sharded[1], loaded))


def test_experts_kept_in_their_blocks_give_the_dequantized_models_tokens(quantized):
    path = quantized
    kept, runner_kept = make_runner(path, keep_quantized_weights=True)  # the kernels in Triton's interpreter
    _, runner_dense = make_runner(path, keep_quantized_weights=False)
    formats = {(i, name): qtype for i, layer in enumerate(kept.model.model.layers)
               for name, qtype in layer.mlp.experts.formats.items()}
    assert formats == {(layer, f"{kind}_proj"): qtype for (layer, kind), qtype in EXPERT_TYPES.items()}
    logits, reference = [], []
    tokens = greedy_paged(runner_kept, PROMPT[:9], 3, TABLE, logits)
    assert tokens == greedy_paged(runner_dense, PROMPT[:9], 3, TABLE, reference)
    logits, reference = torch.cat(logits), torch.cat(reference)
    assert (logits - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_plan_counts_expert_blocks_at_their_stored_size(quantized):
    path = quantized
    config, stored, how = load_plan_model(str(path), bytes_per_param=2.0)
    tensors = gguf.GGUFReader(path).tensors
    experts = [t for t in tensors if t.name.endswith("_exps.weight")]
    quantized = [t for t in experts if t.tensor_type.name != "F32"]
    assert len(quantized) == len(EXPERT_TYPES)
    dense = sum(int(t.n_elements) * 2 for t in tensors if t.name.split(".")[0] != "rope_freqs")
    assert stored == dense - sum(int(t.n_elements) * 2 - int(t.n_bytes) for t in quantized) < dense
    assert "quantized blocks kept" in how


def test_a_type_the_kernels_do_not_read_is_refused_before_loading(converted, tmp_path, monkeypatch):
    def iq2(name, values):
        if name != "blk.1.ffn_down_exps.weight":
            return None
        experts, rows, columns = values.shape
        return [(name, np.zeros((experts, rows, columns // 256 * 66), np.uint8), Q.IQ2_XXS)]

    path = rewrite_gguf(converted, tmp_path / "iq2.gguf", iq2)
    monkeypatch.setattr("localserve.loading.hf._stream_weights", lambda *args, **kwargs: pytest.fail("loaded"))
    with pytest.raises(GGUFLoadError) as info:
        load_model(path)
    message = str(info.value)
    assert "'blk.1.ffn_down_exps.weight'" in message and "IQ2_XXS" in message and "\n" not in message


def test_expert_count_disagreeing_with_the_metadata_is_refused_naming_the_tensor(converted, tmp_path):
    path = rewrite_gguf(converted, tmp_path / "six.gguf", metadata={"qwen3moe.expert_count": 6})
    with pytest.raises(GGUFLoadError) as info:
        load_model(path)
    message = str(info.value)
    assert "blk.0.ffn_" in message and "(8, " in message and "(6, " in message and "\n" not in message


def test_unknown_architectures_are_refused_listing_the_supported_ones(converted, tmp_path, sharded):
    with pytest.raises(Exception, match=r"unsupported architecture 'grok'; supported: .*qwen3moe") as info:
        load_model(rewrite_gguf(converted, tmp_path / "grok.gguf", architecture="grok"))
    assert "\n" not in str(info.value)
    config = json.loads((sharded[0] / "config.json").read_text())
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["GrokForCausalLM"]}))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['GrokForCausalLM'\]; .*Qwen3MoeForCausalLM"):
        load_model(folder)
    (folder / "config.json").write_text(json.dumps(config | {"rope_parameters": {"rope_type": "dynamic",
                                                                                 "rope_theta": 1e6}}))
    with pytest.raises(ModelLoadError, match=r"unsupported rope type 'dynamic' in rope_parameters"):
        load_model(folder)
