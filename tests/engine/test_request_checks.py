"""engine/request_checks.py: each refusal of `LLMEngine.validate` at its bound and one past it (no block taken)."""

from __future__ import annotations

import pytest

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams


@pytest.fixture
def engine(tiny64):
    return build_engine(tiny64, None, EngineConfig(num_kv_blocks=4, block_size=16, max_num_seqs=2,
                                                   max_model_len=48))


def test_the_prompt_plus_max_tokens_fits_the_context_at_the_limit_and_not_one_past(engine):
    engine.validate([1] * 40, SamplingParams(max_tokens=8))  # 48 = the context
    with pytest.raises(ValueError, match=r"the prompt \(40 tokens\) plus max_tokens \(9\) exceeds the context "
                                         r"length of 48 tokens"):
        engine.validate([1] * 40, SamplingParams(max_tokens=9))


def test_ids_in_the_vocabulary_only(engine):
    vocab = engine.model_config.vocab_size
    engine.validate([vocab - 1], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {vocab}\)"):
        engine.validate([vocab], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.validate([], SamplingParams(max_tokens=1))


def test_samples_at_most_the_slots(engine):
    engine.validate([1] * 4, SamplingParams(max_tokens=2, n=2))
    with pytest.raises(ValueError, match="n=3 exceeds the 2 parallel slots"):
        engine.validate([1] * 4, SamplingParams(max_tokens=2, n=3))


def test_stop_strings_need_a_tokenizer(engine):
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.validate([1] * 4, SamplingParams(max_tokens=2, stop=["x"]))
    assert not engine.requests  # nothing was taken
