"""EngineConfig checks what it is given when it is made, before anything is loaded: KV format names are
parsed into KVFormatSpecs then, and an unknown attention backend is refused then."""

from __future__ import annotations

import dataclasses

import pytest

from localserve.engine.config import EngineConfig
from localserve.kv.formats import FORMAT_NAMES, KVFormatSpec, Q4Options


def test_format_names_are_parsed_into_specs_when_the_config_is_made():
    config = EngineConfig(cache_type_k="F16", cache_type_v="q4_rot:-mean")
    assert config.cache_type_k == KVFormatSpec("fp16")
    assert config.cache_type_v == KVFormatSpec("q4_rot", Q4Options(mean=False))
    assert dataclasses.replace(config, num_kv_blocks=7).cache_type_v == config.cache_type_v  # a spec stays as is
    assert EngineConfig().cache_type_k is None  # the model's dtype, decided by the builder


@pytest.mark.parametrize("field", ["cache_type_k", "cache_type_v"])
def test_an_unknown_format_is_refused_naming_the_valid_ones(field):
    with pytest.raises(ValueError, match=f"unknown KV cache type 'q5_9'; choose from {', '.join(FORMAT_NAMES)}$"):
        EngineConfig(**{field: "q5_9"})
    with pytest.raises(ValueError, match="unknown KV format option '-mean' for q8_0"):
        EngineConfig(**{field: "q8_0:-mean"})


def test_an_unknown_attention_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; known: auto, torch, triton"):
        EngineConfig(attention_backend="flash")
    assert EngineConfig(attention_backend="triton").attention_backend == "triton"  # checked by name only


@pytest.mark.parametrize("max_model_len, served", [(None, 2048), (1, 1), (2047, 2047), (2048, 2048), (2049, 2048)])
def test_the_context_served_is_max_model_len_at_most_the_models_own(max_model_len, served):
    assert EngineConfig(max_model_len=max_model_len).model_len(2048) == served
