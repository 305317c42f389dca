"""Gemma 3 against transformers on the same random weights, windows of 16 tokens crossed several times by
the prompt and the generation: from its save_pretrained folder, as the text part of a multimodal checkpoint,
from a GGUF made by llama.cpp's own converter, on generated configs (hypothesis) and at the window's limits;
and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from localserve.models.config import ModelConfigError
from localserve.models.registry import config_from_hf

from localserve.loading.hf import ModelLoadError, load_model
from tests.helpers.gemma_models import WINDOW, assert_matches_without_cache, check_generated_config, gemma3_config
from tests.helpers.gguf_convert import convert, write_spm_tokenizer
from tests.helpers.models import assert_matches_transformers, make_runner, save_random_model

PROMPT = torch.randint(3, 320, (50,), generator=torch.Generator().manual_seed(5)).tolist()
TABLE = [3, 0, 6, 2, 9, 1, 4]  # 7 blocks of 16: the prompt and 30 generated tokens


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    # the head size as query_pre_attn_scalar: llama.cpp's GGUFs keep none and assume it (but for the 27B)
    folder = tmp_path_factory.mktemp("gemma3")
    hf_model = save_random_model(folder, gemma3_config(query_pre_attn_scalar=16))
    write_spm_tokenizer(folder, 320)
    return folder, hf_model


def test_folder_matches_transformers_across_windows(gemma3):
    folder, hf_model = gemma3
    loaded, runner = make_runner(folder)
    config = loaded.config
    windows = [config.attention_of(i).sliding_window for i in range(6)]
    assert windows == [WINDOW] * 5 + [None] and config.context_length == 2048
    full, local = config.attention_of(5).rope, config.attention_of(0).rope
    assert (full.theta, full.rope_type, full.factor) == (1e6, "linear", 8.0)
    assert (local.theta, local.rope_type) == (1e4, "default")
    assert config.attention_scale == pytest.approx(16 ** -0.5) and config.final_logit_softcap == 30.0
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE, num_tokens=30)


def test_multimodal_checkpoint_serves_its_language_model(tmp_path):
    import transformers

    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    # transformers' multimodal class never soft-caps its logits (Gemma 3's checkpoints set no cap): none here
    text = gemma3_config(num_hidden_layers=2, sliding_window_pattern=2, final_logit_softcapping=None)
    config = transformers.Gemma3Config(text_config=text,
                                       vision_config=vision.to_dict(), mm_tokens_per_image=4)
    hf_model = save_random_model(tmp_path, config, model_class=transformers.Gemma3ForConditionalGeneration)
    loaded, runner = make_runner(tmp_path)
    assert loaded.config.architecture == "Gemma3ForConditionalGeneration"
    assert loaded.config.unloaded_parts == ("vision tower", "multimodal projector")
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE, num_tokens=8)


def test_gguf_from_llama_cpp_converter_matches_transformers(gemma3, tmp_path):
    folder, hf_model = gemma3
    path = convert(folder, tmp_path / "gemma3.gguf", "--outtype", "f32")
    loaded, runner = make_runner(path)
    config = loaded.config
    assert config.architecture == "Gemma3ForCausalLM" and config.gemma.norm_offset == 0.0  # the 1 is in the file
    assert [config.attention_of(i).sliding_window for i in range(6)] == [WINDOW] * 5 + [None]
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE, num_tokens=30)


def test_bfloat16_greedy_tokens_follow_transformers(gemma3):
    folder, _ = gemma3
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    loaded, runner = make_runner(folder, dtype=torch.bfloat16)
    ours = runner.prompt_logits(PROMPT, TABLE)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("window", [1, 2, 49, 50, 51])
def test_window_limits_match_transformers(tmp_path, window):
    """A window of one key (only itself), of two, one short of the prompt, the prompt, one past it (and a
    query_pre_attn_scalar unlike the head size). The tokens are transformers' without its KV cache: with a
    window of 1 its cached generate departs from its own forward pass from the second token on."""
    hf_model = save_random_model(tmp_path, gemma3_config(sliding_window=window, num_hidden_layers=2,
                                                         sliding_window_pattern=2))
    _, runner = make_runner(tmp_path)
    assert_matches_without_cache(runner, hf_model, PROMPT, TABLE)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # each example saves a model: no shrinking
@given(window=st.integers(1, 24), layers=st.integers(1, 4), pattern=st.integers(1, 4),
       heads=st.sampled_from([(4, 1), (4, 2), (2, 2)]),
       head_dim=st.sampled_from([8, 16, 32]), scalar=st.sampled_from([8, 16, 100]),
       final_cap=st.sampled_from([None, 5.0, 30.0]), attn_cap=st.sampled_from([None, 2.0, 50.0]),
       length=st.integers(1, 48), seed=st.integers(0, 2 ** 16))
def test_generated_configs_match_transformers(tmp_path_factory, window, layers, pattern, heads, head_dim, scalar,
                                              final_cap, attn_cap, length, seed):
    config = gemma3_config(sliding_window=window, num_hidden_layers=layers, sliding_window_pattern=pattern,
                           num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=head_dim,
                           query_pre_attn_scalar=scalar, final_logit_softcapping=final_cap,
                           attn_logit_softcapping=attn_cap)
    check_generated_config(tmp_path_factory.mktemp("generated"), config, length, seed, TABLE)


def read(config: dict) -> None:
    config_from_hf(config | {"architectures": ["Gemma3ForCausalLM"]})


def test_bad_configs_are_refused_naming_the_field():
    base = gemma3_config().to_dict()
    cases = {"use_bidirectional_attention": {"use_bidirectional_attention": True},
             "hidden_activation": {"hidden_activation": "relu"},
             "layer_types": {"layer_types": ["sliding_attention", "chunked_attention"] * 3},
             "rope_parameters.full_attention": {"rope_parameters": {"full_attention": {"rope_type": "dynamic"},
                                                                    "sliding_attention": {}}}}
    for field, change in cases.items():
        with pytest.raises(ModelConfigError, match=field.replace(".", r"\.")):
            read(base | change)


def test_a_folder_with_a_bad_config_is_refused_at_load(gemma3, tmp_path):
    folder, _ = gemma3
    for name in ("model.safetensors", "tokenizer.model"):
        (tmp_path / name).symlink_to(folder / name)
    config = json.loads((folder / "config.json").read_text()) | {"hidden_activation": "relu"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="hidden_activation"):
        load_model(tmp_path)


def test_a_multimodal_config_without_the_text_defaults_reads_as_transformers_reads_it():
    """gemma-3-4b-it's config.json leaves vocab_size (and more) to Gemma3TextConfig's defaults."""
    import transformers

    text = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
            "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
              "vision_config": {"model_type": "siglip_vision_model"}}
    ours = config_from_hf(config)
    theirs = transformers.Gemma3Config(**config).text_config
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.vocab_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)
    assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5 and ours.tie_word_embeddings
    assert [ours.attention_of(i).sliding_window for i in range(6)] == [1024] * 5 + [None]
