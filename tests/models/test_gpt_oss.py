"""gpt-oss against transformers on the same random weights (tests/helpers/gpt_oss_models.py: windows of 16,
random sinks, clamps that cut): from a save_pretrained folder, from that folder with its experts as the
released MXFP4 `_blocks`/`_scales` (against transformers' own dequantization; dequantized here and kept in
blocks), from GGUFs made by llama.cpp's own converter (dense, and from the MXFP4 folder: MXFP4 experts);
prompts and generations several windows long through the paged cache; and what is refused."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import gguf
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localserve.loading.hf import ModelLoadError, load_model
from tests.helpers.gguf_convert import convert
from tests.helpers.gpt_oss_models import (
    WINDOW,
    mxfp4_reference,
    save_gpt_oss,
    tiny_config,
    write_mxfp4_folder,
)
from tests.helpers.models import greedy_paged, make_runner

PROMPT = torch.randint(3, 320, (5 * WINDOW - 3,), generator=torch.Generator().manual_seed(7)).tolist()
TABLE = [9, 1, 14, 3, 0, 6, 12, 4, 10]  # 144 tokens: the prompt and 60 generated
NUM_TOKENS = 60


def transformers_greedy(hf_model, prompt: list[int], num_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' prompt logits and greedy tokens, each step a whole forward pass: its KV cache keeps
    nothing of a window of 1 (transformers 5.25's cached generate then differs from its own forward)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
        tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0, use_cache=False)[0, len(prompt):].tolist()
    return logits, tokens


def assert_matches(runner, hf_model, prompt=PROMPT, num_tokens=NUM_TOKENS, table=TABLE, tolerance=2e-5) -> float:
    """Prompt logits within `tolerance` of transformers' (relative to their largest) and `num_tokens` greedy
    tokens identical; returns the largest difference."""
    theirs, expected = transformers_greedy(hf_model, prompt, num_tokens)
    ours = runner.prompt_logits(prompt, table)
    difference = (ours - theirs).abs().max().item()
    assert difference <= tolerance * theirs.abs().max().item(), (difference, theirs.abs().max().item())
    assert greedy_paged(runner, prompt, num_tokens, table) == expected
    return difference


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    return folder, save_gpt_oss(folder, tiny_config())


@pytest.fixture(scope="module")
def mxfp4(dense, tmp_path_factory):
    folder = write_mxfp4_folder(dense[0], tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    return folder, mxfp4_reference(folder)


def test_save_pretrained_folder(dense):
    folder, hf_model = dense
    loaded, runner = make_runner(folder)
    config = loaded.config
    assert [layer.sliding_window for layer in config.layer_attention] == [WINDOW, None, WINDOW]
    assert config.moe.activation == "clamped_swiglu" and config.moe.router == "topk_softmax"
    assert config.rope.rope_type == "yarn" and not config.rope.truncate
    sinks = [layer.self_attn.geometry.sinks for layer in loaded.model.model.layers]
    assert all(torch.equal(ours, theirs.self_attn.sinks) for ours, theirs in zip(sinks, hf_model.model.layers))
    assert min(s.min() for s in sinks) < 0 < max(s.max() for s in sinks)
    assert_matches(runner, hf_model)


def test_the_clamp_and_the_sinks_matter(dense):
    """The model's gate/up pre-activations pass the limit, and without sinks or windows transformers' own
    logits move: the comparisons above test all three."""
    folder, hf_model = dense
    import copy

    gate_up = hf_model.model.layers[0].mlp.experts.gate_up_proj
    seen = []
    handle = hf_model.model.layers[0].mlp.experts.register_forward_hook(
        lambda module, args, out: seen.append(args[0] @ gate_up[0]))
    with torch.no_grad():
        base = hf_model(torch.tensor([PROMPT])).logits
    handle.remove()
    assert (seen[0].abs() > 7.0).float().mean() > 0.01
    for change in ("sinks", "window"):
        other = copy.deepcopy(hf_model)
        with torch.no_grad():
            if change == "sinks":
                for layer in other.model.layers:
                    layer.self_attn.sinks.fill_(-1e4)
            else:
                other.config.layer_types = ["full_attention"] * 3
            changed = other(torch.tensor([PROMPT])).logits
        assert (changed - base).abs().max() > 0.1, change


def test_mxfp4_experts_against_transformers_dequantization(mxfp4):
    folder, reference = mxfp4
    loaded, runner = make_runner(folder)
    assert loaded.config.moe.num_experts == 4
    assert_matches(runner, reference)


def test_mxfp4_experts_kept_in_blocks_give_the_dequantized_models_tokens(mxfp4):
    folder, _ = mxfp4
    kept, runner_kept = make_runner(folder, keep_quantized_weights=True)  # dequantized by the interpreter
    assert {qtype for layer in kept.model.model.layers for qtype in layer.mlp.experts.formats.values()} == {"MXFP4"}
    _, runner_dense = make_runner(folder)
    logits, reference = [], []
    prompt = PROMPT[:2 * WINDOW + 3]
    assert greedy_paged(runner_kept, prompt, 4, TABLE, logits) == greedy_paged(runner_dense, prompt, 4, TABLE,
                                                                                reference)
    logits, reference = torch.cat(logits), torch.cat(reference)
    assert (logits - reference).abs().max() <= 1e-4 * reference.abs().max()


@pytest.fixture(scope="module")
def converted(dense, tmp_path_factory):
    return convert(dense[0], tmp_path_factory.mktemp("gguf") / "gpt-oss-f32.gguf", "--outtype", "f32",
                   pre_tokenizer="gpt-4o")


def test_gguf_from_llama_cpp_converter(dense, converted):
    loaded, runner = make_runner(converted)
    assert loaded.config.architecture == "GptOssForCausalLM" and loaded.config.attention_sinks
    assert [layer.sliding_window for layer in loaded.config.layer_attention] == [WINDOW, None, WINDOW]
    assert_matches(runner, dense[1])


def test_gguf_with_mxfp4_experts_from_llama_cpp_converter(mxfp4, tmp_path):
    folder, reference = mxfp4
    path = convert(folder, tmp_path / "gpt-oss-mxfp4.gguf", "--outtype", "f32", pre_tokenizer="gpt-4o")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.2.ffn_down_exps.weight"] == "MXFP4"
    _, runner = make_runner(path)
    assert_matches(runner, reference)


def edited(folder, tmp_path, **changes):
    config = json.loads((folder / "config.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("changes,message", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention"]},
     "layer 1's type 'chunked_attention' in layer_types"),
    ({"sliding_window": 0}, "layer 0 is a sliding_attention layer but sliding_window 0"),
    ({"sliding_window": None}, "layer 0 is a sliding_attention layer but sliding_window None"),
    ({"layer_types": ["full_attention"] * 2}, "layer_types has 2 entries for 3 layers"),
    ({"head_dim": 1024}, "layer 0: head size 1024"),
    ({"num_key_value_heads": 3}, "layer 0: 4 query heads cannot share 3 KV heads"),
    ({"swiglu_limit": 0.0}, "swiglu_limit 0.0 must be positive"),
])
def test_configs_the_kernels_cannot_take_are_refused_naming_the_layer_and_value(dense, tmp_path, changes, message):
    with pytest.raises(ModelLoadError) as info:
        load_model(edited(dense[0], tmp_path, **changes))
    assert message in str(info.value) and "\n" not in str(info.value)


def check_generated(tmp, config, prompt_length: int, seed: int, num_tokens: int = 6, **sinks) -> None:
    """A model of `config` (saved without a tokenizer) against transformers: prompt logits and greedy tokens."""
    hf_model = save_gpt_oss(tmp, config, seed=seed, tokenizer=False, **sinks)
    _, runner = make_runner(tmp)
    prompt = torch.randint(3, 320, (prompt_length,), generator=torch.Generator().manual_seed(seed)).tolist()
    assert_matches(runner, hf_model, prompt, num_tokens, table=list(range(8)))


@st.composite
def configs(draw):
    num_kv_heads = draw(st.integers(1, 2))
    num_experts = draw(st.integers(1, 5))
    num_layers = draw(st.integers(1, 3))
    return tiny_config(
        num_hidden_layers=num_layers, num_key_value_heads=num_kv_heads,
        num_attention_heads=num_kv_heads * draw(st.integers(1, 3)), head_dim=draw(st.sampled_from([8, 16, 32])),
        num_local_experts=num_experts, num_experts_per_tok=draw(st.integers(1, num_experts)),
        sliding_window=draw(st.integers(1, 40)), intermediate_size=draw(st.sampled_from([32, 64])),
        layer_types=draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=num_layers,
                                  max_size=num_layers)))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), prompt_length=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_generated_configs_against_transformers(config, prompt_length, seed):
    """Windows, head counts, head sizes, expert counts, k and layer patterns drawn at random; prompts up to
    70 tokens (several windows of most)."""
    with tempfile.TemporaryDirectory() as tmp:
        check_generated(Path(tmp), config, prompt_length, seed)


# At the limits: a window of one key (each query sees itself), a window as long as the prompt and one key
# shorter, every expert chosen (k = E), one expert, sinks that take nearly all the probability and sinks
# that take none.
LIMITS = {
    "window-1": (dict(sliding_window=1), {}),
    "window-prompt": (dict(sliding_window=40), {}),
    "window-prompt-less-1": (dict(sliding_window=39), {}),
    "k-equals-experts": (dict(num_local_experts=3, num_experts_per_tok=3), {}),
    "one-expert": (dict(num_local_experts=1, num_experts_per_tok=1), {}),
    "sinks-dominate": ({}, dict(sink_scale=0.0, sink_offset=30.0)),
    "sinks-vanish": ({}, dict(sink_scale=0.0, sink_offset=-60.0)),
}


@pytest.mark.parametrize("case", LIMITS)
def test_at_the_limits(case, tmp_path):
    changes, sinks = LIMITS[case]
    check_generated(tmp_path, tiny_config(**changes), prompt_length=40, seed=len(case), **sinks)


def resharded(folder, out, shard_of) -> None:
    """`folder`'s model.safetensors split into shards by `shard_of(name)` (a file name), with an index."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    shards: dict[str, dict] = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        shards.setdefault(shard_of(name), {})[name] = tensor
    for file, tensors in shards.items():
        save_file(tensors, out / file, metadata={"format": "pt"})
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text((folder / "config.json").read_text())


def test_mxfp4_halves_in_different_shards_are_one_tensor(mxfp4, tmp_path):
    folder, _ = mxfp4
    resharded(folder, tmp_path / "split", lambda name: "b.safetensors" if name.endswith("_scales") else
              "a.safetensors")
    _, runner = make_runner(tmp_path / "split")
    _, reference = make_runner(folder)
    assert torch.equal(runner.prompt_logits(PROMPT[:20], TABLE), reference.prompt_logits(PROMPT[:20], TABLE))


def test_a_broken_mxfp4_pair_is_refused_naming_the_tensor(mxfp4, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = mxfp4
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_blocks"
    tensors[name] = tensors[name][..., :8].contiguous()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    (broken / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ModelLoadError) as info:
        load_model(broken)
    assert name in str(info.value) and "model.safetensors" in str(info.value) and "\n" not in str(info.value)
