"""`CompletionView` (server/openai/completion_events.py) on its own: a `GenerationStream` fed fixed engine outputs,
read as chat completions and text completions, whole and as stream chunks. Every object must validate
as the `openai` SDK's own type (`ChatCompletion`, `ChatCompletionChunk`, `Completion`) with no field the
type does not know; text, finish reasons, usage and log-probabilities are compared with the script."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pydantic
import pytest
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from localserve.engine.outputs import CompletionOutput, RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.server.generation.stream import GenerationStream
from localserve.server.openai.completion_events import CompletionView

RESPONSE_ID = "resp_0123456789abcdef"
MODEL = "tiny-chat"
NUM_PROMPT_TOKENS = 7
NUM_CACHED_TOKENS = 4
TOKEN_TEXTS = {10: "Par", 11: "is", 12: " is", 13: " big", 14: "é", 15: ".", 20: "alt", 21: "other"}
TOP = [(20, -1.5), (21, -2.5)]  # the alternatives at every position, for the requests that ask for two


@dataclass
class ViewedRequest:
    """What a GenerationStream and a CompletionView read of a request (the request type is the parsers'), and
    the two resolved settings they read from its SamplingParams."""

    num_samples: int = 1
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    generate: bool = True
    stream_id: str | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(n=self.num_samples, logprobs=self.logprobs, max_tokens=16)


def logprob_of(token_id: int) -> float:
    return -0.25 * (token_id - 9)


class EngineScript:
    """Engine outputs for fixed token ids per choice, one step at a time, as the engine reports them."""

    def __init__(self, request: ViewedRequest) -> None:
        self.request = request
        self.tokens: list[list[int]] = [[] for _ in range(request.num_samples)]
        self.finish_reasons: list[str | None] = [None] * request.num_samples

    def step(self, new_tokens: dict[int, list[int]], finish: dict[int, str] | None = None) -> RequestOutput:
        finish = finish or {}
        outputs = []
        for index, tokens in enumerate(self.tokens):
            delta = new_tokens.get(index, [])
            tokens += delta
            self.finish_reasons[index] = self.finish_reasons[index] or finish.get(index)
            wanted = self.request.logprobs is not None
            outputs.append(CompletionOutput(
                index, text(tokens), list(tokens), None, self.finish_reasons[index],
                logprobs=[logprob_of(token) for token in tokens] if wanted else [],
                top_logprobs=[TOP for _ in tokens] if wanted else [], delta_text=text(delta),
                delta_token_ids=list(delta)))
        finished = all(reason is not None for reason in self.finish_reasons)
        return RequestOutput("req-1", [1] * NUM_PROMPT_TOKENS, outputs, finished, num_cached_tokens=NUM_CACHED_TOKENS)


def text(tokens: list[int]) -> str:
    return "".join(TOKEN_TEXTS[token] for token in tokens)


def make_view(chat: bool, include_usage: bool = False, **request: Any) -> tuple[CompletionView, EngineScript]:
    viewed = ViewedRequest(**request)
    stream = GenerationStream(viewed, viewed.params(), RESPONSE_ID, MODEL, NUM_PROMPT_TOKENS,
                              lambda token: TOKEN_TEXTS[token])
    return CompletionView(stream, chat=chat, include_usage=include_usage), EngineScript(viewed)


def assert_sdk_type(model: type[pydantic.BaseModel], obj: dict[str, Any]) -> pydantic.BaseModel:
    """`obj` parsed as the SDK's `model`, which must know every field of it at every depth."""
    parsed = model.model_validate(obj)
    unknown = list(extra_fields(parsed, model.__name__))
    assert unknown == [], unknown
    return parsed


def extra_fields(value: Any, where: str):
    if isinstance(value, pydantic.BaseModel):
        yield from (f"{where}.{name}" for name in (value.model_extra or {}))
        for name in type(value).model_fields:
            yield from extra_fields(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from extra_fields(item, f"{where}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from extra_fields(item, f"{where}[{key!r}]")


def chat_logprob_entry(token: int) -> dict[str, Any]:
    """The expected chat logprobs entry of one token, from the script."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": TOKEN_TEXTS[token_id], "bytes": list(TOKEN_TEXTS[token_id].encode()), "logprob": logprob}
    return {**one(token, logprob_of(token)), "top_logprobs": [one(top_id, top) for top_id, top in TOP]}


def expected_usage(num_output_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": NUM_PROMPT_TOKENS, "completion_tokens": num_output_tokens,
            "total_tokens": NUM_PROMPT_TOKENS + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": NUM_CACHED_TOKENS},
            "completion_tokens_details": {"reasoning_tokens": 0}}


# ------------------------------------------------------------------ whole answers
def test_a_chat_completion_is_the_sdks_type_with_text_finish_reason_and_usage():
    view, script = make_view(chat=True)
    view.stream.absorb(script.step({0: [10, 11]}))
    view.stream.absorb(script.step({0: [12, 13, 15]}, finish={0: "stop"}))
    completion = view.completion()
    parsed = assert_sdk_type(ChatCompletion, completion)
    assert parsed.id == "chatcmpl-0123456789abcdef" and parsed.object == "chat.completion"
    assert (parsed.model, parsed.created) == (MODEL, view.stream.created_at)
    assert [(choice.index, choice.message.role, choice.message.content, choice.finish_reason, choice.logprobs)
            for choice in parsed.choices] == [(0, "assistant", "Paris is big.", "stop", None)]
    assert completion["usage"] == expected_usage(5)
    assert view.ended_normally


def test_a_text_completion_is_the_sdks_type_with_logprobs_and_offsets():
    view, script = make_view(chat=False, logprobs=2)
    view.stream.absorb(script.step({0: [10, 11]}))
    view.stream.absorb(script.step({0: [12, 14]}, finish={0: "length"}))
    completion = view.completion()
    parsed = assert_sdk_type(Completion, completion)
    assert parsed.id == "cmpl-0123456789abcdef" and parsed.object == "text_completion"
    (choice,) = parsed.choices
    tokens = [10, 11, 12, 14]
    assert (choice.text, choice.finish_reason) == ("Paris isé", "length")
    assert choice.logprobs.tokens == [TOKEN_TEXTS[token] for token in tokens]
    assert choice.logprobs.token_logprobs == [logprob_of(token) for token in tokens]
    assert choice.logprobs.top_logprobs == [{TOKEN_TEXTS[top_id]: top for top_id, top in TOP}] * len(tokens)
    assert choice.logprobs.text_offset == [0, 3, 5, 8]  # where each token starts in the text
    assert completion["usage"] == expected_usage(4)
    assert view.ended_normally  # the token limit is a normal end


def test_chat_logprobs_carry_each_token_with_its_bytes_and_alternatives():
    view, script = make_view(chat=True, logprobs=2)
    view.stream.absorb(script.step({0: [10, 14]}, finish={0: "stop"}))
    parsed = assert_sdk_type(ChatCompletion, view.completion())
    (choice,) = parsed.choices
    assert [entry.model_dump() for entry in choice.logprobs.content] == [chat_logprob_entry(10), chat_logprob_entry(14)]
    assert choice.logprobs.content[1].bytes == [0xC3, 0xA9]  # "é" in UTF-8
    assert choice.logprobs.refusal is None


def test_several_choices_each_keep_their_text_and_finish_reason_and_usage_counts_all():
    view, script = make_view(chat=True, num_samples=2)
    view.stream.absorb(script.step({0: [10], 1: [12]}))
    view.stream.absorb(script.step({0: [11], 1: [13, 15]}, finish={1: "stop"}))
    view.stream.absorb(script.step({0: [15]}, finish={0: "length"}))
    completion = view.completion()
    parsed = assert_sdk_type(ChatCompletion, completion)
    assert [(choice.index, choice.message.content, choice.finish_reason) for choice in parsed.choices] == [
        (0, "Paris.", "length"), (1, " is big.", "stop")]
    assert completion["usage"] == expected_usage(6)


# ------------------------------------------------------------------ stream chunks
class StreamedCompletionChoice(CompletionChoice):
    finish_reason: Literal["stop", "length", "content_filter"] | None  # null until the choice ends


class CompletionChunk(Completion):
    """A chunk of /v1/completions: the SDK's `Completion`, whose choices OpenAI streams with a null finish
    reason until they end (the SDK builds its chunks unvalidated, so its type says the choice has ended)."""

    choices: list[StreamedCompletionChoice]


def chunk_type(chat: bool) -> type[pydantic.BaseModel]:
    return ChatCompletionChunk if chat else CompletionChunk


def stream_chunks(view: CompletionView, script: EngineScript, steps: list[tuple[dict, dict]]) -> list[list[dict]]:
    """The chunks drained after each step."""
    drained = []
    for new_tokens, finish in steps:
        view.stream.absorb(script.step(new_tokens, finish))
        drained.append(view.chunks())
    return drained


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
def test_stream_chunks_are_the_sdks_type_and_add_up_to_the_whole_answer(chat, include_usage):
    view, script = make_view(chat=chat, include_usage=include_usage, logprobs=2)
    drained = stream_chunks(view, script, [({0: [10]}, {}), ({0: [11, 12]}, {}), ({0: [14]}, {0: "stop"})])
    chunks = [chunk for step in drained for chunk in step]
    for chunk in chunks:
        parsed = assert_sdk_type(chunk_type(chat), chunk)
        assert (parsed.id, parsed.model, parsed.created) == (view.id, MODEL, view.stream.created_at)
    pieces = [choice["delta"].get("content", "") if chat else choice["text"]
              for chunk in chunks for choice in chunk["choices"]]
    assert "".join(pieces) == text([10, 11, 12, 14])
    finishes = [(choice["index"], choice["finish_reason"]) for chunk in chunks for choice in chunk["choices"]
                if choice["finish_reason"] is not None]
    assert finishes == [(0, "stop")]  # once, in the last choice chunk
    last_choice_chunk = [chunk for chunk in chunks if chunk["choices"]][-1]
    assert last_choice_chunk["choices"][0]["finish_reason"] == "stop"
    assert last_choice_chunk["choices"][0]["delta" if chat else "text"] == ({} if chat else "")
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        entries = [entry for chunk in chunks for choice in chunk["choices"] if choice["logprobs"]
                   for entry in choice["logprobs"]["content"]]
        assert entries == [chat_logprob_entry(token) for token in (10, 11, 12, 14)]
    else:
        offsets = [offset for chunk in chunks for choice in chunk["choices"] if choice["logprobs"]
                   for offset in choice["logprobs"]["text_offset"]]
        assert offsets == [0, 3, 5, 8]  # offsets run on across chunks
    if include_usage:
        assert all(chunk["usage"] is None for chunk in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == expected_usage(4)
    else:
        assert all("usage" not in chunk for chunk in chunks)
    assert view.chunks() == []  # nothing is sent twice


def test_text_absorbed_between_drains_goes_out_as_one_chunk_per_choice():
    view, script = make_view(chat=True, num_samples=2)
    view.chunks()  # the openings
    for new_tokens in ({0: [10], 1: [12]}, {0: [11], 1: [13]}, {0: [15]}):
        view.stream.absorb(script.step(new_tokens))
    chunks = view.chunks()
    assert [(chunk["choices"][0]["index"], chunk["choices"][0]["delta"]) for chunk in chunks] == [
        (0, {"content": "Paris."}), (1, {"content": " is big"})]


def test_each_choice_opens_with_the_role_and_finishes_once_when_it_ends():
    view, script = make_view(chat=True, num_samples=2)
    first = stream_chunks(view, script, [({0: [10], 1: [12]}, {1: "stop"})])[0]
    assert [(chunk["choices"][0]["index"], chunk["choices"][0]["delta"], chunk["choices"][0]["finish_reason"])
            for chunk in first] == [(0, {"role": "assistant", "content": ""}, None),
                                    (1, {"role": "assistant", "content": ""}, None),
                                    (0, {"content": "Par"}, None), (1, {"content": " is"}, None)]
    # choice 1 has stopped; its finish goes out once every choice is done (the request's outcome decides)
    last = stream_chunks(view, script, [({0: [11]}, {0: "length"})])[0]
    assert [(chunk["choices"][0]["index"], chunk["choices"][0]["finish_reason"]) for chunk in last] == [
        (0, None), (0, "length"), (1, "stop")]
    for chunk in first + last:
        assert_sdk_type(ChatCompletionChunk, chunk)


@pytest.mark.parametrize("end", [GenerationStream.cancel, GenerationStream.shut_down,
                                 lambda stream: stream.fail("the engine failed")], ids=["cancel", "shut_down", "fail"])
def test_a_stream_that_did_not_end_normally_sends_no_finish_and_no_usage(end):
    view, script = make_view(chat=True, include_usage=True)
    view.stream.absorb(script.step({0: [10, 11]}))
    sent = view.chunks()
    end(view.stream)
    assert not view.ended_normally
    rest = view.chunks()
    assert all(choice["finish_reason"] is None for chunk in sent + rest for choice in chunk["choices"])
    assert all(chunk["usage"] is None for chunk in sent + rest)


def test_no_chunk_before_anything_is_absorbed_but_the_chat_opening():
    chat_view, _ = make_view(chat=True)
    assert [chunk["choices"][0]["delta"] for chunk in chat_view.chunks()] == [{"role": "assistant", "content": ""}]
    assert chat_view.chunks() == []
    text_view, _ = make_view(chat=False)
    assert text_view.chunks() == []
