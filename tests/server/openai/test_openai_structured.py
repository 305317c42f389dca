"""Structured output over the wire on the default model, with the official `openai` SDK: `response_format`
json_schema (strict) in 20 seeded requests at temperature 1.0, sent at once, every answer complete and valid
against its schema (jsonschema); with them, the Responses API's `text.format` in 4 more. (It replaces the engine-level
version of the same 20 runs: the engine's grammar rules are tested on small models in tests/engine.)"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.helpers.schemas import PERSON
from tests.helpers.server import make_llm, running_server, wait_until_idle

NUM_RUNS = 20
NUM_RESPONSES = 4
PROMPT = "Describe a person as a JSON object with their name, age, city and hobbies."


@pytest.mark.slow
def test_json_schema_answers_validate_in_20_concurrent_seeded_runs_at_temperature_1(smollm2_path):
    llm = make_llm(smollm2_path, num_kv_blocks=512, max_num_seqs=NUM_RUNS + NUM_RESPONSES, max_model_len=2048)
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    text_format = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}

    async def run_all(port: int) -> list:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            chats = [client.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPT}],
                                                    temperature=1.0, seed=seed, max_tokens=200,
                                                    response_format=response_format) for seed in range(NUM_RUNS)]
            responses = [client.responses.create(model="default", input=PROMPT, temperature=1.0, max_output_tokens=200,
                                                 text=text_format, extra_body={"localserve": {"seed": 100 + seed}})
                         for seed in range(NUM_RESPONSES)]
            return await asyncio.gather(*chats, *responses)

    with running_server(llm) as server:
        answers = asyncio.run(run_all(server.port))
        wait_until_idle(server.server.models.serving_now().engine)
    answers, responses = answers[:NUM_RUNS], answers[NUM_RUNS:]
    for response in responses:
        assert response.status == "completed", response
        jsonschema.validate(json.loads(response.output_text), PERSON)
    texts = []
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.append(choice.message.content)
    assert len(set(texts)) > 10  # sampled at temperature 1, not one answer twenty times
