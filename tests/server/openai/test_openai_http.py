"""OpenAI's HTTP API against the official `openai` SDK (tiny model): chat completions streamed and not,
n, stop, length, logprobs, cached prompt tokens; text completions; Responses over HTTP streamed and not
with previous_response_id. Every answer is parsed into the SDK's own types (the SDK itself builds them;
`model_validate` with strict extra-field checks catches what it would let through). Greedy text is the
same over /v1/chat/completions, HTTP /v1/responses and the websocket mode."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from websockets.asyncio.client import connect

from tests.helpers.server import collect_response, openai_client, running_server, wait_until_idle

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
PROMPT = "hello world tell me a story about the cat and the dog"
# long enough for several full 16-token blocks: a second request with it finds them in the prefix cache
LONG_SYSTEM = " ".join(["you are a helpful assistant who will answer every question with good answers"] * 6)


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, model_alias="tiny-chat") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server.port) as client:
        yield client


def strict(model_type, value):
    """`value` (an SDK object) dumped and validated again: every field has the SDK's type."""
    dumped = value.model_dump(mode="json", exclude_unset=True)
    assert type(value).model_validate(dumped) == value
    assert model_type.model_validate(dumped).model_dump(exclude_unset=True) == value.model_dump(exclude_unset=True)
    return dumped


def greedy_chat(client, **fields):
    return client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": PROMPT}],
                                          temperature=0, **fields)


def test_chat_completion_whole_and_streamed_agree(server, client):
    whole = greedy_chat(client, max_tokens=12)
    assert isinstance(whole, ChatCompletion) and whole.object == "chat.completion"
    strict(ChatCompletion, whole)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(greedy_chat(client, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        assert isinstance(chunk, ChatCompletionChunk)
        strict(ChatCompletionChunk, chunk)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == choice.message.content
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])
    wait_until_idle(server.server.models.serving_now().engine)


def test_max_tokens_reaches_length_and_max_completion_tokens_wins(client):
    answer = greedy_chat(client, max_tokens=2)
    if answer.choices[0].finish_reason == "length":
        assert answer.usage.completion_tokens == 2
    preferred = greedy_chat(client, max_tokens=50, max_completion_tokens=1)
    assert preferred.choices[0].finish_reason == "length" and preferred.usage.completion_tokens == 1
    assert answer.choices[0].message.content.startswith(preferred.choices[0].message.content)


def test_n_samples_and_stop(client):
    two = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": PROMPT}],
                                         n=2, max_tokens=6, temperature=1.0, seed=5)
    strict(ChatCompletion, two)
    assert [choice.index for choice in two.choices] == [0, 1]
    assert two.usage.completion_tokens == sum(
        len(choice.message.content.split()) for choice in two.choices)  # a word-level tokenizer: a word a token
    streamed = list(client.chat.completions.create(model="tiny-chat", n=2, max_tokens=6, stream=True,
                                                   messages=[{"role": "user", "content": PROMPT}]))
    assert {chunk.choices[0].index for chunk in streamed} == {0, 1}

    full = greedy_chat(client, max_tokens=10).choices[0].message.content.split(" ")
    assert len(full) >= 3, full
    stop_word = full[2]
    cut = greedy_chat(client, max_tokens=10, stop=[stop_word, "never said"])
    assert cut.choices[0].finish_reason == "stop"
    assert stop_word not in cut.choices[0].message.content.split(" ")
    assert " ".join(full).startswith(cut.choices[0].message.content)


def test_logprobs_in_the_sdk_shape(client):
    answer = greedy_chat(client, max_tokens=4, logprobs=True, top_logprobs=3)
    strict(ChatCompletion, answer)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # greedy: the chosen token is the likeliest one
        assert entry.logprob == pytest.approx(max(top.logprob for top in entry.top_logprobs), abs=1e-4)
    assert "".join(entry.token for entry in content).replace(" ", "") == \
        answer.choices[0].message.content.replace(" ", "")


def test_a_second_request_sharing_a_long_system_prompt_reports_cached_tokens(client):
    def ask(question: str):
        return client.chat.completions.create(model="tiny-chat", max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}])

    first, second = ask("what is the capital of france"), ask("where is the river")
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_text_completions(client):
    whole = client.completions.create(model="tiny-chat", prompt="hello world the cat", max_tokens=5, temperature=0,
                                      logprobs=2)
    assert isinstance(whole, Completion) and whole.object == "text_completion"
    strict(Completion, whole)
    assert whole.usage.prompt_tokens == 4 and whole.usage.completion_tokens <= 5
    assert len(whole.choices[0].logprobs.tokens) == whole.usage.completion_tokens
    streamed = list(client.completions.create(model="tiny-chat", prompt="hello world the cat", max_tokens=5,
                                              temperature=0, stream=True))
    for chunk in streamed:  # OpenAI's own chunks carry finish_reason null until the last; the SDK types
        assert isinstance(chunk, Completion)  # it non-null, so only the last is validated whole
    strict(Completion, streamed[-1])
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    default = client.completions.create(model="tiny-chat", prompt="hello world the cat", temperature=0)
    assert default.usage.completion_tokens <= 16  # OpenAI's default max_tokens for this endpoint


def test_responses_over_http_whole_streamed_and_continued(server, client):
    first = client.responses.create(model="tiny-chat", input=PROMPT, max_output_tokens=6, temperature=0,
                                    instructions="you are a helpful assistant")
    assert isinstance(first, Response) and first.status in ("completed", "incomplete")
    strict(Response, first)
    events = list(client.responses.create(model="tiny-chat", input="and then what", max_output_tokens=6,
                                          temperature=0, previous_response_id=first.id, stream=True))
    for event in events:
        assert event == STREAM_EVENT.validate_python(event.model_dump(mode="json", exclude_unset=True))
    second = events[-1].response
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert second.previous_response_id == first.id
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # it saw the first turn
    # the conversation went on from stored text: the same continuation over the websocket mode
    assert second.output_text == asyncio.run(websocket_text(server.port, {
        "input": "and then what", "max_output_tokens": 6, "temperature": 0, "previous_response_id": first.id}))
    with pytest.raises(openai.BadRequestError) as missing:  # as OpenAI answers it
        client.responses.create(model="tiny-chat", input="hi", previous_response_id="resp_nope")
    assert missing.value.body["code"] == "previous_response_not_found"


async def websocket_text(port: int, fields: dict) -> str:
    async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
        await connection.send(json.dumps({"type": "response.create", **fields}))
        events = await collect_response(connection)
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    return "".join(part["text"] for item in events[-1]["response"]["output"] for part in item["content"])


def test_greedy_text_is_identical_over_chat_completions_http_responses_and_websockets(server, client):
    chat = greedy_chat(client, max_tokens=16).choices[0].message.content
    http_response = client.responses.create(model="tiny-chat", input=PROMPT, max_output_tokens=16,
                                            temperature=0).output_text
    over_websocket = asyncio.run(websocket_text(server.port, {"input": PROMPT, "max_output_tokens": 16,
                                                              "temperature": 0}))
    assert chat == http_response == over_websocket and chat


def test_errors_in_the_sdk_shape(client):
    cases = [(openai.BadRequestError, dict(messages=[])), (openai.BadRequestError, dict(messages="hi")),
             (openai.BadRequestError, dict(messages=[{"role": "user", "content": "hi"}], temperature=9)),
             (openai.BadRequestError, dict(messages=[{"role": "user", "content": "hi"}], frobnicate=1)),
             (openai.NotFoundError, dict(messages=[{"role": "user", "content": "hi"}], model="other-model"))]
    for error_type, fields in cases:
        fields.setdefault("model", "tiny-chat")
        extra = {"frobnicate": fields.pop("frobnicate")} if "frobnicate" in fields else None
        with pytest.raises(error_type) as raised:
            client.chat.completions.create(**fields, extra_body=extra)
        body = raised.value.body
        assert set(body) == {"message", "type", "param", "code"} and body["message"], body


def test_seed_and_the_llama_cpp_sampling_fields_are_honoured(client):
    def sample(**fields):
        return client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=8, temperature=1.0, **fields).choices[0].message.content

    assert sample(seed=7) == sample(seed=7)
    assert len({sample(seed=seed) for seed in range(4)}) > 1
    greedy = greedy_chat(client, max_tokens=8).choices[0].message.content
    assert sample(seed=3, extra_body={"top_k": 1}) == greedy  # one candidate: the likeliest
    assert sample(seed=3, extra_body={"min_p": 0.999}) == greedy  # only tokens about as likely as the top one
    with pytest.raises(openai.BadRequestError) as refused:
        sample(extra_body={"repetition_penalty": 0})
    assert refused.value.body["param"] == "repetition_penalty"
