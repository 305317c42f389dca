"""The text part of Mistral Small 3.x / Devstral / Magistral / Ministral 3 against transformers on the same
random weights: a `Mistral3ForConditionalGeneration` checkpoint (vision tower and projector left unloaded,
and said so) with Ministral 3's text config (yarn from two mscales, queries scaled past the original
context) and with Mistral Small's, from its save_pretrained folder and from a GGUF made by llama.cpp's own
converter."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers.gguf_convert import convert, write_spm_tokenizer
from tests.helpers.models import assert_matches_transformers, make_runner, save_random_model

PROMPT = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(9)).tolist()
TABLE = [2, 5, 0, 4]
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            rms_norm_eps=1e-6)


def multimodal_config(text_config):
    import transformers

    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=8)
    return transformers.Mistral3Config(text_config=text_config.to_dict(), vision_config=vision.to_dict())


@pytest.fixture(scope="module")
def ministral3(tmp_path_factory):
    import transformers

    # An original context of 16 tokens: past it the queries are scaled (llama_4_scaling_beta), and yarn's
    # frequencies interpolate.
    text = transformers.Ministral3Config(**TEXT, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3})
    folder = tmp_path_factory.mktemp("ministral3")
    hf_model = save_random_model(folder, multimodal_config(text),
                                 model_class=transformers.Mistral3ForConditionalGeneration)
    write_spm_tokenizer(folder, 320)
    return folder, hf_model


def test_ministral3_text_model_matches_transformers_and_leaves_the_vision_tower(ministral3, caplog):
    folder, hf_model = ministral3
    with caplog.at_level(logging.INFO, logger="localserve.loading.hf"):
        loaded, runner = make_runner(folder)
    assert "its vision tower is left unloaded" in caplog.text
    assert loaded.config.rope.query_scale_beta == 0.3 and loaded.config.rope.attention_factor == 1.0
    assert not any("vision" in name or "projector" in name for name, _ in loaded.model.named_parameters())
    assert_matches_transformers(runner, hf_model.eval(), PROMPT, TABLE)


def test_ministral3_gguf_from_llama_cpp_converter_matches_transformers(ministral3, tmp_path):
    folder, hf_model = ministral3
    loaded, runner = make_runner(convert(folder, tmp_path / "ministral3.gguf", "--outtype", "f32"))
    assert loaded.config.architecture == "Mistral3ForConditionalGeneration"
    assert loaded.config.rope.query_scale_beta == pytest.approx(0.3)
    assert_matches_transformers(runner, hf_model.eval(), PROMPT, TABLE)


def test_mistral_small_text_model_matches_transformers(tmp_path):
    import transformers

    hf_model = save_random_model(tmp_path, multimodal_config(transformers.MistralConfig(**TEXT, sliding_window=None)),
                                 seed=2, model_class=transformers.Mistral3ForConditionalGeneration)
    loaded, runner = make_runner(tmp_path)
    assert loaded.config.unloaded_parts == ("vision tower", "multimodal projector")
    assert_matches_transformers(runner, hf_model.eval(), PROMPT, TABLE)
