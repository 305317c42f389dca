"""The server's sampling defaults fill in what a response.create leaves out, field by field, and
/v1/models lists them; with them the default model answers the newcomer's first question."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from websockets.asyncio.client import connect

from localserve.loading.sampling_defaults import SamplingDefaults, sampling_defaults
from tests.helpers.server import collect_response, make_llm, running_server

QUESTION = "What is the capital of France?"


async def texts(port: int, creates: list[dict]) -> list[str]:
    """The text of one response per create, each on its own connection, all at once."""
    async def one(create: dict) -> str:
        async with connect(f"ws://127.0.0.1:{port}/v1/responses") as client:
            await client.send(json.dumps({"type": "response.create", **create}))
            events = await collect_response(client)
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
            return events[-1]["response"]["output"][0]["content"][0]["text"]
    return await asyncio.gather(*(one(create) for create in creates))


def test_defaults_apply_to_each_field_a_request_leaves_out(tiny_chat_llm):
    creates = [{"input": "tell me a story", "max_output_tokens": 16, "localserve": {"seed": seed}}
               for seed in range(5)]
    greedy = {"input": "tell me a story", "max_output_tokens": 16, "temperature": 0}
    only_top_k = SamplingDefaults(1.0, top_k=1, source="test")  # sampling from one token: greedy
    with running_server(tiny_chat_llm, sampling_defaults=only_top_k) as server:
        filtered = asyncio.run(texts(server.port, creates + [greedy, creates[0] | {"temperature": 1.0}]))
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models") as response:
            models = json.load(response)
    assert len(set(filtered)) == 1  # top_k 1 from the defaults, also under the request's own temperature
    assert models["data"][0]["sampling_defaults"] == {"temperature": 1.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0,
                                                      "source": "test"}
    with running_server(tiny_chat_llm, sampling_defaults=SamplingDefaults(1.0, source="unfiltered")) as server:
        unfiltered = asyncio.run(texts(server.port, creates))
    assert len(set(unfiltered)) > 1 and set(unfiltered) != {filtered[0]}  # the same seeds, sampled


@pytest.mark.slow
def test_default_model_answers_paris_under_the_server_defaults(smollm2_path):
    llm = make_llm(smollm2_path, num_kv_blocks=512, max_model_len=2048)
    defaults = sampling_defaults(smollm2_path, is_default_model=True)
    creates = [{"input": QUESTION, "max_output_tokens": 16, "localserve": {"seed": seed}} for seed in range(10)]
    with running_server(llm, sampling_defaults=defaults) as server:
        answers = asyncio.run(texts(server.port, creates))
    assert sum("Paris" in answer for answer in answers) >= 9, answers
