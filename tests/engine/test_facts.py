"""An engine's facts, read once into a torch-free record: what the server and the monitor know of it."""

from __future__ import annotations

import dataclasses

from localserve.engine.engine_thread import EngineThread
from localserve.engine.facts import CAPACITY_FORMATS, EngineFacts, read_facts


def test_the_facts_of_the_tiny_chat_engine(tiny_chat_llm):
    engine = tiny_chat_llm.engine
    facts = read_facts(engine)
    config = engine.model_config
    # make_llm's settings (tests/helpers/server.py): 256 blocks of 16, 16 slots, 256-token steps, context 512
    assert (facts.max_model_len, facts.num_gpu_blocks, facts.block_size) == (512, 256, 16)
    assert (facts.max_num_seqs, facts.max_num_batched_tokens, facts.num_cpu_blocks) == (16, 256, 0)
    assert (facts.cache_type_k, facts.cache_type_v, facts.vocab_size) == ("fp32", "fp32", config.vocab_size)
    # K and V of every layer in the model's float32: 4 bytes a value
    assert facts.kv_bytes_per_token == config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    assert facts.kv_cache_bytes == 256 * 16 * facts.kv_bytes_per_token
    assert [row.format for row in facts.capacity] == ["fp16", "q4_rot"]  # q8_0 needs head_dim % 32 == 0
    fp16 = facts.capacity[0]
    assert fp16.num_tokens == facts.kv_cache_bytes // fp16.bytes_per_token == 2 * 256 * 16  # half of fp32
    assert set(row.format for row in facts.capacity) <= {str(spec) for spec in CAPACITY_FORMATS}
    assert EngineThread(engine).facts == facts  # the engine thread offers the same record


def test_the_record_is_plain_data():
    fields = {field.name: field.type for field in dataclasses.fields(EngineFacts)}
    assert "engine" not in fields and all("torch" not in str(kind) for kind in fields.values())
    assert EngineFacts.__dataclass_params__.frozen
