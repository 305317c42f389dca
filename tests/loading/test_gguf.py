"""GGUF loading: a tiny quantized GGUF against its safetensors twin, and SmolLM2 against transformers."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from safetensors.torch import save_file

from localserve.loading.gguf import GGUFLoadError, unpermute_rotary
from localserve.loading.hf import load_model
from tests.helpers.gguf import llama_cpp_permute, write_llama_gguf
from tests.helpers.models import greedy_paged, make_runner

Q = gguf.GGMLQuantizationType


def test_unpermute_inverts_llama_cpp_permute():
    weight = torch.randn(4 * 16, 8)
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), 4))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary(permuted, 4), weight)


@pytest.mark.parametrize("arch", ["llama", "smollm2"])
def test_quantized_gguf_matches_safetensors_twin(tiny_model_dir, tmp_path, arch):
    folder, hf_model = tiny_model_dir(arch)
    gguf_path = tmp_path / "tiny.gguf"
    twin = write_llama_gguf(gguf_path, hf_model, {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "ffn_": Q.Q4_1,
                                                   "attn_output": Q.Q5_0, "token_embd": Q.Q8_0})
    twin_dir = tmp_path / "twin"
    twin_dir.mkdir()
    save_file({k: v.contiguous() for k, v in twin.items()}, twin_dir / "model.safetensors")
    (twin_dir / "config.json").write_text((folder / "config.json").read_text())

    from_gguf, runner_gguf = make_runner(gguf_path)
    from_twin, runner_twin = make_runner(twin_dir)
    assert from_gguf.config.tie_word_embeddings == (arch == "smollm2")
    for name, param in from_twin.model.named_parameters():
        assert torch.equal(dict(from_gguf.model.named_parameters())[name], param), name
    prompt = list(range(3, 67))
    table = list(range(5))
    diff = (runner_gguf.prompt_logits(prompt, table) - runner_twin.prompt_logits(prompt, table)).abs().max()
    assert diff.item() == 0.0
    # Quantization really happened: the twin differs from the original float weights.
    original = hf_model.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(twin["model.layers.0.self_attn.k_proj.weight"], original)


def test_gguf_with_unknown_tensor_type_is_a_clear_error(tiny_model_dir, tmp_path):
    _, hf_model = tiny_model_dir("llama")
    path = tmp_path / "bad.gguf"
    write_llama_gguf(path, hf_model, {})
    # Rewrite the type id of the first tensor (F32 = 0) to 99, which no GGML version defines.
    reader = gguf.GGUFReader(path)
    tensor = reader.tensors[0]
    # Tensor info: name length (u64), name, n_dims (u32), dims (u64 each), ggml type (u32), data offset.
    offset = tensor.field.offset + 8 + len(tensor.name.encode()) + 4 + 8 * len(tensor.shape)
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[offset:offset + 4], "little") == 0
    data[offset:offset + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFLoadError) as info:
        load_model(path)
    message = str(info.value)
    assert str(path) in message and "99" in message and "\n" not in message


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2, smollm2_hf):
    from localserve.attention.torch_backend import TorchAttentionBackend
    from localserve.engine.model_runner import ModelRunner
    from localserve.kv.cache import PagedKVCache

    config = smollm2.config
    runner = ModelRunner(smollm2.model, PagedKVCache(config.num_layers, 8, 16, config.num_kv_heads,
                                                    config.head_dim, torch.float32), TorchAttentionBackend())
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 140)), [28, 3030, 2386, 30, 216]]
    for prompt in prompts:
        ours = runner.prompt_logits(prompt, list(range(8)))
        with torch.no_grad():
            theirs = smollm2_hf(torch.tensor([prompt])).logits[0]
        assert (ours - theirs).abs().max().item() < 1e-3
        with torch.no_grad():
            expected = smollm2_hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert greedy_paged(runner, prompt, 32, list(range(8))) == expected


def test_missing_shard_named_in_index(tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir("llama")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(Exception) as info:
        load_model(tmp_path)
    assert "model-00001-of-00002.safetensors" in str(info.value) and "missing" in str(info.value)
