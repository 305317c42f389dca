"""Gemma 4 against transformers on the same random weights, dense and with experts beside the dense MLP,
windows of 16 tokens crossed several times: the full layers with twice the head size, one KV head, values
from the key projection and proportional rope; from save_pretrained folders, as the text part of a
multimodal checkpoint, from GGUFs made by llama.cpp's own converter, on generated configs (hypothesis);
and what is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from localserve.models.config import ModelConfigError
from localserve.models.registry import config_from_hf

from localserve.loading.hf import load_model
from tests.helpers.gemma_models import (
    WINDOW,
    check_generated_config,
    gemma4_config,
    write_byte_fallback_tokenizer,
)
from tests.helpers.gguf_convert import convert, rewrite_gguf
from tests.helpers.models import assert_matches_transformers, greedy_paged, make_runner, save_random_model

PROMPT = torch.randint(3, 320, (50,), generator=torch.Generator().manual_seed(6)).tolist()
TABLE = [3, 0, 6, 2, 9, 1, 4]  # 7 blocks of 16: the prompt and 30 generated tokens


@pytest.fixture(scope="module", params=["dense", "moe"])
def gemma4(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    hf_model = save_random_model(folder, gemma4_config(moe=request.param == "moe"))
    write_byte_fallback_tokenizer(folder, 320)
    return folder, hf_model


def test_folder_matches_transformers_across_windows(gemma4):
    folder, hf_model = gemma4
    loaded, runner = make_runner(folder)
    config = loaded.config
    shapes = [config.attention_of(i) for i in range(4)]
    assert [(s.num_kv_heads, s.head_dim, s.sliding_window) for s in shapes] == [(2, 16, WINDOW)] * 3 + [(1, 32, None)]
    assert (shapes[3].rope.rope_type, shapes[3].rope.partial_rotary_factor) == ("proportional", 0.25)
    assert config.gemma.values_from_keys and not hasattr(loaded.model.model.layers[3].self_attn, "v_proj")
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE, num_tokens=30)


@pytest.fixture(scope="module")
def converted(gemma4, tmp_path_factory):
    return convert(gemma4[0], tmp_path_factory.mktemp("gguf") / "gemma4.gguf", "--outtype", "f32")


def test_gguf_from_llama_cpp_converter_matches_transformers(gemma4, converted):
    _, hf_model = gemma4
    loaded, runner = make_runner(converted)
    assert loaded.config.architecture == "Gemma4ForCausalLM"
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE, num_tokens=30)


def test_multimodal_checkpoint_serves_its_language_model(tmp_path):
    import transformers

    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                             position_embedding_size=64)
    config = transformers.Gemma4Config(text_config=gemma4_config(moe=True).to_dict(), vision_config=vision.to_dict())
    hf_model = save_random_model(tmp_path, config, model_class=transformers.Gemma4ForConditionalGeneration)
    loaded, runner = make_runner(tmp_path)
    assert loaded.config.architecture == "Gemma4ForConditionalGeneration"
    assert loaded.config.unloaded_parts == ("vision tower",) and loaded.config.moe.num_experts == 4
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE, num_tokens=8)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # each example saves a model: no shrinking
@given(window=st.integers(1, 24), layers=st.integers(1, 4), full_every=st.integers(1, 3),
       heads=st.sampled_from([(4, 1), (4, 2), (2, 2)]), head_dim=st.sampled_from([8, 16]),
       full_shape=st.sampled_from([(16, 1), (32, 2), (64, 1)]), k_eq_v=st.booleans(),
       partial=st.sampled_from([0.25, 0.5, 1.0]), experts=st.sampled_from([None, (4, 1), (4, 4), (6, 2)]),
       final_cap=st.sampled_from([None, 5.0, 30.0]), length=st.integers(1, 48), seed=st.integers(0, 2 ** 16))
def test_generated_configs_match_transformers(tmp_path_factory, window, layers, full_every, heads, head_dim,
                                              full_shape, k_eq_v, partial, experts, final_cap, length, seed):
    kinds = ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(layers)]
    kinds[-1] = "full_attention"  # transformers forces the last layer full
    moe = dict(enable_moe_block=True, num_experts=experts[0], top_k_experts=experts[1],
               moe_intermediate_size=16) if experts else {"enable_moe_block": False}
    ropes = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": partial,
                                "rope_theta": 1_000_000.0}}
    config = gemma4_config(num_hidden_layers=layers, layer_types=kinds, sliding_window=window,
                           num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=head_dim,
                           global_head_dim=full_shape[0], num_global_key_value_heads=full_shape[1],
                           attention_k_eq_v=k_eq_v, rope_parameters=ropes, final_logit_softcapping=final_cap, **moe)
    check_generated_config(tmp_path_factory.mktemp("generated"), config, length, seed, TABLE)


def read(config: dict) -> None:
    config_from_hf(config | {"architectures": ["Gemma4ForCausalLM"]})


@pytest.mark.parametrize(("field", "change"), [
    ("hidden_size_per_layer_input", {"hidden_size_per_layer_input": 256}),
    ("num_kv_shared_layers", {"num_kv_shared_layers": 2}),
    ("use_bidirectional_attention", {"use_bidirectional_attention": "all"}),
    ("per_layer_config", {"per_layer_config": {"3": {"head_dim": 32, "intermediate_size": 64}}}),
    ("layer_types", {"layer_types": ["sliding_attention"] * 3}),
    ("enable_moe_block", {"enable_moe_block": True, "num_experts": None}),
    ("num_experts_per_tok", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5,
                             "moe_intermediate_size": 8}),
])
def test_bad_configs_are_refused_naming_the_field(field, change):
    with pytest.raises(ModelConfigError, match=field):
        read(gemma4_config().to_dict() | change)


@pytest.mark.parametrize(("key", "value"), [("gemma4.embedding_length_per_layer_input", 256),
                                          ("gemma4.attention.shared_kv_layers", 2)])
def test_e2b_features_in_a_gguf_are_refused_at_load_naming_the_key(converted, tmp_path, key, value):
    changed = rewrite_gguf(converted, tmp_path / "changed.gguf", metadata={key: value})
    with pytest.raises(ModelConfigError, match=key.removeprefix("gemma4.")):
        load_model(changed)


def test_gguf_experts_kept_in_q8_0_blocks_give_the_dequantized_models_tokens(gemma4, converted, tmp_path):
    """The MoE model's expert stacks in Q8_0, kept in their blocks (the fused GeGLU kernels, in Triton's
    interpreter) against the same file dequantized at load."""
    import gguf

    if gemma4[1].config.enable_moe_block is False:
        pytest.skip("the dense model has no experts")

    def q8(name, values):
        if not name.endswith("_exps.weight"):
            return None
        return [(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)]

    path = rewrite_gguf(converted, tmp_path / "q8.gguf", q8)
    kept, runner_kept = make_runner(path, keep_quantized_weights=True)
    experts = kept.model.model.layers[0].experts
    assert experts.formats and experts.activation["activation"] == "gelu_tanh"
    _, runner_dense = make_runner(path, keep_quantized_weights=False)
    logits, reference = [], []
    assert greedy_paged(runner_kept, PROMPT[:20], 4, TABLE, logits) == greedy_paged(runner_dense, PROMPT[:20], 4,
                                                                                    TABLE, reference)
    logits, reference = torch.cat(logits), torch.cat(reference)
    assert (logits - reference).abs().max() <= 1e-4 * reference.abs().max()
