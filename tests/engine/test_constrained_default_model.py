"""Structured output on the default model, at the engine: a strict JSON schema, 20 seeded runs at
temperature 1.0, every answer complete and valid against the schema (jsonschema). The server's test of
`response_format: json_schema` over the wire comes with the server's fields."""

from __future__ import annotations

import json

import jsonschema
import pytest

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.grammar import GrammarSpec
from localserve.engine.sampling_params import SamplingParams
from tests.helpers.schemas import PERSON
from tests.helpers.tokenizers import smollm2_tokenizer


@pytest.mark.slow
def test_json_schema_answers_validate_in_20_seeded_runs_at_temperature_1(smollm2):
    tokenizer = smollm2_tokenizer()
    engine = build_engine(smollm2.model, tokenizer, EngineConfig(num_kv_blocks=512, max_num_seqs=20))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Describe a person as a JSON object with their "
                                                                "name, age, city and hobbies."}])
    grammar = GrammarSpec.json_schema(PERSON)
    ids = [engine.add_request(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=200, grammar=grammar))
           for seed in range(20)]
    final = engine.run_to_completion()
    texts = []
    for request_id in ids:
        output = final[request_id].outputs[0]
        assert output.finish_reason == "stop", f"{request_id}: {output.finish_reason} ({output.text!r})"
        jsonschema.validate(json.loads(output.text), PERSON)
        texts.append(output.text)
    assert len(set(texts)) > 10  # sampled at temperature 1, not one answer twenty times
