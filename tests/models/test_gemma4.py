"""Gemma 4 against transformers on the same random weights, dense and with experts beside the dense MLP,
windows of 16 tokens crossed several times: the full layers with twice the head size, one KV head, values
from the key projection and proportional rope; from save_pretrained folders, as the text part of a
multimodal checkpoint, from GGUFs made by llama.cpp's own converter, on generated configs (hypothesis);
and what is refused."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gemma_models import WINDOW, gemma4_config, write_byte_fallback_tokenizer
from tests.helpers.gguf_convert import convert
from tests.helpers.models import assert_matches_transformers, make_runner, save_random_model

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


def test_gguf_from_llama_cpp_converter_matches_transformers(gemma4, tmp_path):
    folder, hf_model = gemma4
    path = convert(folder, tmp_path / "gemma4.gguf", "--outtype", "f32")
    loaded, runner = make_runner(path)
    assert loaded.config.architecture == "Gemma4ForCausalLM"
    assert_matches_transformers(runner, hf_model, PROMPT, TABLE, num_tokens=30)
