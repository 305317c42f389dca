"""GGUFs of the hybrid families made by llama.cpp's own converter (`qwen35`, `qwen35moe`, `qwen3next`) out of
tiny random transformers models: the config they read equals the Hugging Face folder's but for the layout
switches of the linear layers (the file's layout is read as stored), every tensor equals the folder's in
that layout, and the logits equal transformers' with the prompt prefilled in two chunks. One file of each
family, converted once per module."""

from __future__ import annotations

import dataclasses
import json

import gguf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.models.config import ModelConfigError
from localserve.models.family import Target
from localserve.models.layers.linear import QuantizedLinear
from localserve.models.registry import family
from safetensors.torch import load_file, save_file

from localserve.loading.hf import load_model, read_model_config
from localserve.loading.plan_model import load_plan_model
from tests.helpers.gguf_convert import convert, rewrite_gguf, write_bpe_tokenizer
from tests.helpers.hybrid_models import (
    Chunk,
    HybridDriver,
    qwen3_5_config,
    qwen3_5_moe_config,
    qwen3_next_config,
    save_hybrid,
    transformers_logits,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPT = torch.randint(3, 320, (37,), generator=torch.Generator().manual_seed(11)).tolist()
# llama.cpp's qwen3next has experts in every layer (its converter cannot name a dense MLP's tensors)
CONFIGS = {"qwen35": qwen3_5_config, "qwen35moe": qwen3_5_moe_config,
           "qwen3next": lambda: qwen3_next_config(mlp_only_layers=[])}


def add_mtp_block(folder) -> None:
    """Give a saved Qwen3.5 folder one multi-token-prediction block (`mtp.*`, as the real checkpoints carry;
    transformers neither makes nor reads them): a copy of the full-attention layer 2 and its projections."""
    weights = load_file(folder / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    for name, tensor in list(weights.items()):
        if name.startswith("model.layers.2."):
            weights["mtp.layers.0." + name.removeprefix("model.layers.2.")] = tensor.clone()
    weights |= {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.randn(hidden),
                "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden),
                "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden)}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))


@pytest.fixture(scope="module", params=list(CONFIGS))
def converted(request, tmp_path_factory):
    """(architecture, HF folder, transformers model, f32 GGUF); the qwen35 one with an MTP block."""
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    hf_model = save_hybrid(folder, CONFIGS[arch](), seed=len(arch))
    write_bpe_tokenizer(folder, 320, SPECIALS)
    options = ["--outtype", "f32"]
    if arch == "qwen35":
        add_mtp_block(folder)
    else:
        options.append("--no-mtp")  # the converter wants MTP tensors unless told there are none
    path = convert(folder, tmp_path_factory.mktemp("gguf") / f"{arch}.gguf", *options, pre_tokenizer="qwen2")
    return arch, folder, hf_model, path


def test_config_equals_the_folders(converted):
    arch, folder, _, path = converted
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == arch
    theirs, _ = read_model_config(folder)
    ours, _ = read_model_config(path)
    layout = {name: getattr(ours.linear_attention, name) for name in LAYOUT}
    assert layout == {"norm_offset": 0.0, "log_decay_rate": False, "fused_qkvz": False,
                      "fused_ba": arch == "qwen3next", "tiled_value_heads": arch != "qwen3next"}
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    linear = dataclasses.replace(ours.linear_attention, **{name: getattr(theirs.linear_attention, name)
                                                           for name in LAYOUT})
    same = dataclasses.replace(ours, name=theirs.name, linear_attention=linear, rms_norm_eps=theirs.rms_norm_eps)
    assert same == theirs
    assert ours.recurrent_layers == (0, 1, 3) and ours.rotary_dim == 8
    if arch == "qwen35":  # its MTP block: counted in the file, neither loaded nor planned
        reader = gguf.GGUFReader(path)
        assert reader.fields["qwen35.block_count"].contents() == 5
        assert ours.num_layers == 4 and ours.unloaded_parts == ("multi-token prediction layers",)
        _, planned, _ = load_plan_model(str(path), bytes_per_param=2.0)
        decoder = [t for t in reader.tensors if not t.name.startswith("blk.4.")]
        assert len(decoder) < len(reader.tensors) and planned == sum(int(t.n_elements) * 2 for t in decoder)


LAYOUT = ("norm_offset", "log_decay_rate", "fused_qkvz", "fused_ba", "tiled_value_heads")


def test_every_tensor_equals_the_folders_in_the_files_layout(converted):
    """Each parameter loaded from the GGUF equals the folder's put in the file's layout here, independently
    of the converter: norms 1 + w, A = -exp(A_log), Qwen3.5's value heads tiled, Qwen3-Next's q, k, v, z
    unfused."""
    arch, folder, _, path = converted
    ours = dict(load_model(path, dtype=torch.float32).model.named_parameters())
    theirs = dict(load_model(folder, dtype=torch.float32).model.named_parameters())
    expected = file_layout(theirs, read_model_config(folder)[0].linear_attention, tiled=arch != "qwen3next")
    assert set(ours) == set(expected)
    for name, param in ours.items():
        torch.testing.assert_close(param, expected[name], rtol=1e-6, atol=1e-6, msg=name)


def file_layout(params: dict[str, torch.Tensor], linear, tiled: bool) -> dict[str, torch.Tensor]:
    """A Hugging Face layout model's parameters in llama.cpp's layout (see the module doc)."""
    k_heads, group = linear.num_key_heads, linear.num_value_heads // linear.num_key_heads
    key_dim, v_dim = linear.key_dim, linear.value_head_dim

    def tile(tensor, head_dim, dim=0, start=0):  # value heads [Hk, group, d] -> [group, Hk, d] along dim
        if not tiled:
            return tensor
        head, part = tensor.split((start, tensor.shape[dim] - start), dim=dim) if dim == 0 else (None, tensor)
        moved = part.movedim(dim, 0)
        moved = moved.reshape(k_heads, group, head_dim, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape)
        part = moved.movedim(0, dim)
        return part if head is None else torch.cat([head, part])

    out = {}
    for name, param in params.items():
        mixer, _, leaf = name.partition("linear_attn.")
        if not leaf:
            is_norm = name.endswith("norm.weight")
            out[name] = param + 1 if is_norm else param
        elif leaf == "A_log":
            out[mixer + "linear_attn.A"] = tile(-param.exp(), 1)
        elif leaf == "dt_bias" or leaf.startswith(("in_proj_b.", "in_proj_a.")):
            out[name] = tile(param, 1)
        elif leaf.startswith(("in_proj_qkv.", "conv1d.")):
            out[name] = tile(param, v_dim, start=2 * key_dim)
        elif leaf.startswith("in_proj_z."):
            out[name] = tile(param, v_dim)
        elif leaf.startswith("out_proj."):
            out[name] = tile(param, v_dim, dim=1)
        elif leaf == "in_proj_qkvz.weight":  # per key head q, k, v, z -> all q, all k, all v; all z
            sizes = (linear.key_head_dim, linear.key_head_dim, group * v_dim, group * v_dim)
            q, k, v, z = param.view(k_heads, -1, param.shape[-1]).split(sizes, dim=1)
            out[mixer + "linear_attn.in_proj_qkv.weight"] = torch.cat(
                [part.reshape(-1, param.shape[-1]) for part in (q, k, v)])
            out[mixer + "linear_attn.in_proj_z.weight"] = z.reshape(-1, param.shape[-1])
        else:  # the gated norm, in_proj_ba: as stored
            out[name] = param
    return out


def test_logits_equal_transformers_prefilled_in_two_chunks(converted):
    _, _, hf_model, path = converted
    driver = HybridDriver(load_model(path, dtype=torch.float32).model)
    ours = driver.prefill_in_pieces(PROMPT, [13], [0, 1, 2])
    theirs = transformers_logits(hf_model, PROMPT)
    assert (ours - theirs).abs().max().item() < 1e-4
    step = driver.step([Chunk([int(ours[-1].argmax())], len(PROMPT), 0, [(1, 0)], [0, 1, 2])])
    expected = transformers_logits(hf_model, [*PROMPT, int(theirs[-1].argmax())])[-1]
    assert (step[0] - expected).abs().max().item() < 1e-4


def test_f16_matrices_load_as_their_rounded_values(converted, tmp_path):
    """The file's matrices rewritten in F16 (as `--outtype f16` stores them): each parameter is the f32
    file's rounded to f16, moved the same way (a model this wide and random turns f16's rounding into logit
    differences of ~1, so the weights are compared, not the logits)."""
    arch, _, _, path = converted

    def to_f16(name, values):
        if values.ndim < 2:
            return None
        return [(name, values.astype("float16"), gguf.GGMLQuantizationType.F16)]

    lowered = rewrite_gguf(path, tmp_path / f"{arch}-f16.gguf", to_f16)
    assert {t.tensor_type.name for t in gguf.GGUFReader(lowered).tensors if len(t.shape) > 1} == {"F16"}
    ours = dict(load_model(lowered, dtype=torch.float32).model.named_parameters())
    full = dict(load_model(path, dtype=torch.float32).model.named_parameters())
    for name, param in ours.items():
        matrix = "norm" not in name and param.dim() > 1 and not name.endswith("conv1d.weight")
        expected = full[name].half().float() if matrix or name.endswith("conv1d.weight") else full[name]
        assert torch.equal(param, expected), name


def test_mixer_projections_kept_in_their_blocks_give_the_dequantized_logits(converted, tmp_path):
    """The mixers' and attention's projections in Q8_0, kept in their blocks (the kernels in Triton's
    interpreter), as the file stores them: the logits equal the dequantized model's."""
    arch, _, _, path = converted
    q8 = gguf.GGMLQuantizationType.Q8_0
    kinds = (".attn_qkv.", ".attn_gate.", ".ssm_beta.", ".ssm_alpha.", ".ssm_ba.", ".ssm_out.", ".attn_q.")

    def quantize(name, values):
        if not any(kind in name for kind in kinds):
            return None
        return [(name, gguf.quants.quantize(values, q8), q8)]

    quantized = rewrite_gguf(path, tmp_path / f"{arch}-q8.gguf", quantize)
    kept = load_model(quantized, dtype=torch.float32, keep_quantized_weights=True).model
    dense = load_model(quantized, dtype=torch.float32, keep_quantized_weights=False).model
    mixer = kept.model.layers[0].linear_attn
    projections = ("in_proj_qkv", "in_proj_z", "out_proj") + (("in_proj_ba",) if arch == "qwen3next" else
                                                              ("in_proj_b", "in_proj_a"))
    assert all(isinstance(getattr(mixer, name), QuantizedLinear) for name in projections)
    ours = HybridDriver(kept).prefill_in_pieces(PROMPT[:20], [7], [0, 1])
    reference = HybridDriver(dense).prefill_in_pieces(PROMPT[:20], [7], [0, 1])
    assert (ours - reference).abs().max() <= 1e-4 * reference.abs().max()


class Overridden:
    """A GGUF's metadata with some of its architecture's keys changed (None: absent)."""

    def __init__(self, meta, **keys) -> None:
        self.meta, self.keys = meta, {key.replace("__", "."): value for key, value in keys.items()}
        self.architecture, self.source, self.tensor_names = meta.architecture, meta.source, meta.tensor_names

    def get(self, key, default=None):
        value = self.keys[key] if key in self.keys else self.meta.get(key)
        return default if value is None else value

    def general(self, key, default=None):
        return self.meta.general(key, default)

    def tensor_shape(self, name):
        return self.meta.tensor_shape(name)

    def tensor_values(self, name):
        return self.meta.tensor_values(name)


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    """The metadata of a converted qwen35moe file (its own small conversion, kept apart from `converted`)."""
    from localserve.loading.gguf import ReaderMetadata, open_gguf

    folder = tmp_path_factory.mktemp("meta")
    save_hybrid(folder, qwen3_5_moe_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    write_bpe_tokenizer(folder, 320, SPECIALS)
    path = convert(folder, tmp_path_factory.mktemp("gguf") / "meta.gguf", "--outtype", "f32", "--no-mtp",
                   pre_tokenizer="qwen2")
    return ReaderMetadata(open_gguf(path), path)


@pytest.mark.parametrize(("keys", "message"), [
    ({"ssm__group_count": None}, r"needs qwen35moe\.ssm\.group_count"),
    ({"ssm__inner_size": 30}, r"ssm\.inner_size 30 is not a multiple of ssm\.time_step_rank 4"),
    ({"ssm__time_step_rank": 3, "ssm__inner_size": 24}, "must be a multiple of linear_num_key_heads"),
    ({"attention__recurrent_layers": [True]}, r"recurrent_layers has 1 entries for 2 layers"),
    ({"attention__recurrent_layers": None, "full_attention_interval": 0}, r"full_attention_interval must be >= 1"),
    ({"expert_used_count": None}, r"needs qwen35moe\.expert_used_count"),
    ({"nextn_predict_layers": 2}, "leaves no decoder layer"),
    ({"attention__recurrent_layers": [True, True]}, "no full-attention layer among the 2 layers"),
])
def test_bad_metadata_is_named(meta, keys, message):
    with pytest.raises(ModelConfigError, match=message):
        family("qwen3_5_moe").gguf_config(Overridden(meta, **keys))


def test_layer_kinds_without_the_recurrent_list_follow_the_interval(meta):
    from localserve.models.qwen3_5_gguf import recurrent_layers

    assert recurrent_layers(meta, 2) == [True, False]
    older = Overridden(meta, attention__recurrent_layers=None, full_attention_interval=2)
    assert recurrent_layers(older, 4) == [True, False, True, False]
    config = family("qwen3_5_moe").gguf_config(Overridden(meta, attention__recurrent_layers=None,
                                                          full_attention_interval=2))
    assert config.recurrent_layers == (0,)


def test_unknown_and_mtp_tensors(meta):
    config = family("qwen3_5_moe").gguf_config(meta)
    found = family("qwen3_5_moe")
    assert found.gguf_targets("blk.0.ssm_unknown.weight", config) is None
    assert found.gguf_targets("blk.2.nextn.eh_proj.weight", config) == []  # past the decoder: an MTP block
    assert found.gguf_targets("blk.0.ssm_a", config) == [Target("model.layers.0.linear_attn.A")]
    assert found.gguf_targets("blk.0.ssm_dt.bias", config) == [Target("model.layers.0.linear_attn.dt_bias")]
    # the attention layer's fused attn_qkv (no such file from the converter) splits as any decoder's
    assert [t.name for t in found.gguf_targets("blk.1.attn_qkv.weight", config)] == [
        f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]


@settings(max_examples=30, deadline=None)
@given(num_layers=st.integers(1, 12), mtp=st.integers(0, 2), interval=st.integers(1, 6))
def test_layer_kinds_and_mtp_blocks_for_generated_counts(meta, num_layers, mtp, interval):
    """A file of `num_layers` decoder blocks and `mtp` MTP blocks after them, its layer kinds by the interval
    alone (an older converter's file): the decoder's layers and kinds, and every MTP tensor left out."""
    older = Overridden(meta, block_count=num_layers + mtp, nextn_predict_layers=mtp, full_attention_interval=interval,
                       attention__recurrent_layers=None)
    if num_layers < interval:
        with pytest.raises(ModelConfigError, match="no full-attention layer"):
            family("qwen3_5_moe").gguf_config(older)
        return
    config = family("qwen3_5_moe").gguf_config(older)
    assert config.num_layers == num_layers
    assert config.recurrent_layers == tuple(layer for layer in range(num_layers) if (layer + 1) % interval)
    assert ("multi-token prediction layers" in config.unloaded_parts) == (mtp > 0)
    for layer in range(num_layers, num_layers + mtp):
        for name in ("attn_norm.weight", "attn_q.weight", "nextn.eh_proj.weight", "ssm_a"):
            assert family("qwen3_5_moe").gguf_targets(f"blk.{layer}.{name}", config) == []


def test_greedy_tokens_through_the_engine_equal_transformers(converted):
    """Two prompts batched through the engine, prefilled in chunks of 24 tokens (off the 16-token blocks),
    with a state checkpoint every two blocks: each one's greedy tokens are transformers' own."""
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from localserve.engine.sampling_params import SamplingParams
    from tests.helpers.engine_checks import run_requests

    _, _, hf_model, path = converted
    model = load_model(path, dtype=torch.float32).model
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=24,
                                                    state_checkpoint_tokens=32, check_integrity=True))
    prompts = [PROMPT, PROMPT[5:25]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = run_requests(engine, [(prompt, params) for prompt in prompts], check=True)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(output.outputs[0].token_ids) == expected


def test_preemption_through_the_engine_keeps_the_roomy_pools_tokens(converted):
    """Four short prompts growing past a pool of 6 blocks: running sequences are preempted (recomputed, or
    swapped out and in with their states) and each still gives what a roomy pool gives it."""
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from localserve.engine.sampling_params import SamplingParams
    from tests.helpers.engine_checks import run_requests

    model = load_model(converted[3], dtype=torch.float32).model
    work = [(PROMPT[start:start + length], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            for start, length in ((0, 6), (6, 10), (16, 14), (19, 18))]

    def tokens(**config) -> tuple[list[list[int]], int]:
        engine = build_engine(model, None, EngineConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 24,
                                                           "state_checkpoint_tokens": 32, "check_integrity": True,
                                                           **config}))
        outputs = run_requests(engine, work, check=True)
        return [list(output.outputs[0].token_ids) for output in outputs], engine.num_preemptions

    expected, _ = tokens(num_kv_blocks=32)
    for mode in ("recompute", "swap"):
        got, preemptions = tokens(num_kv_blocks=6, num_cpu_blocks=32, preemption_mode=mode)
        assert preemptions > 0, mode
        assert got == expected, mode
