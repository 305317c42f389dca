"""Phi-3 / Phi-4 against transformers on the same random weights: fused qkv_proj and gate_up_proj, rotary
embedding on 3/4 of each head and longrope scaling (Phi-4-mini's shape), from its save_pretrained folder
and from a GGUF made by llama.cpp's own converter; the tool format its template writes."""

from __future__ import annotations

import pytest
import torch

from localserve.tokenizer.chat_format import detect_tool_format
from tests.helpers.gguf_convert import convert, write_spm_tokenizer
from tests.helpers.llama_cpp_files import template_text
from tests.helpers.models import assert_matches_transformers, make_runner, save_random_model

PROMPT = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(5)).tolist()
TABLE = [3, 0, 6, 2]


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    import transformers

    # longrope's original context (64) is beyond the 52 positions run here: its short factors apply, as in
    # transformers (which switches every position to the long factors once a sequence passes it).
    config = transformers.Phi3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
        partial_rotary_factor=0.75, rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 5 for i in range(6)],
                                                  "long_factor": [2.0 + i for i in range(6)]},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6)
    folder = tmp_path_factory.mktemp("phi3")
    hf_model = save_random_model(folder, config)
    write_spm_tokenizer(folder, 320)
    return folder, hf_model


def test_phi3_folder_matches_transformers(phi):
    folder, hf_model = phi
    loaded, runner = make_runner(folder)
    assert (loaded.config.rotary_dim, loaded.config.rope.rope_type) == (12, "longrope")
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE)


def test_phi3_gguf_from_llama_cpp_converter_matches_transformers(phi, tmp_path):
    folder, hf_model = phi
    path = convert(folder, tmp_path / "phi3.gguf", "--outtype", "f32")
    loaded, runner = make_runner(path)
    assert loaded.config.architecture == "Phi3ForCausalLM" and loaded.config.rotary_dim == 12
    assert loaded.config.rope.short_factor == pytest.approx([1.0 + i / 5 for i in range(6)])
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE)


@pytest.mark.parametrize(("template", "tool_format"), [
    ("microsoft-Phi-3.5-mini-instruct.jinja", "json"),  # no tool syntax of its own: the generic JSON calls
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral_args"),
    ("unsloth-mistral-Devstral-Small-2507.jinja", "mistral_args"),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral_args"),
])
def test_tool_format_detected_from_the_template(template, tool_format):
    assert detect_tool_format(template_text(template)).name == tool_format


def test_a_calibrated_kv_format_is_refused_for_a_partly_rotated_head(phi):
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig

    loaded, _ = make_runner(phi[0])
    with pytest.raises(ValueError, match="need the rotary embedding over whole heads; this model turns 12 of 16"):
        build_engine(loaded.model, None, EngineConfig(num_kv_blocks=8, cache_type_k="q4_rot", cache_type_v="q4_rot"))
