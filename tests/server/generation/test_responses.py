"""`GenerationService` (server/generation/service.py) on a played engine thread that records what it is given
(tests/helpers/engine_access.py) and a tokenizer that makes one token per character: previous_response_id
found, not found, or another connection's `store: false` one; the conversation's size, the context, the
output tokens cut to the room left and the log-probabilities' size, each at its bound and one past it; the
running limit; cancel, abandon and shutdown each freeing the engine's blocks (abort) and storing or not as
documented; the latency histograms observed as tokens arrive."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from localserve.server.config import ServerConfig
from localserve.server.generation.conversations import ConversationStore
from localserve.server.generation.service import GenerationService
from localserve.server.generation.stream import GenerationStream
from localserve.server.monitor.metrics import ServerMetrics
from localserve.server.openai.completions_format import CHAT_COMPLETIONS, COMPLETIONS
from localserve.server.openai.responses_format import RESPONSES_HTTP, RESPONSES_WEBSOCKET
from localserve.server.registry.registry import serving_loaded
from localserve.server.request.fields import WireFormat, parse_request
from localserve.server.request.generation_request import RequestLimits
from localserve.server.request.validation import ProtocolError
from tests.helpers.engine_access import CountingTokenizer, RecordedEngineThread

LIMITS = RequestLimits(max_conversation_chars=20, max_logprob_entries=12)


class Served:
    """A GenerationService over a recorded engine thread, and what it was handed."""

    def __init__(self, max_model_len: int = 100, limits: RequestLimits = LIMITS,
                 tokenizer: CountingTokenizer | None = None, **config: Any) -> None:
        self.engine = RecordedEngineThread(max_model_len)
        self.tokenizer = tokenizer or CountingTokenizer()
        self.config = ServerConfig(limits=limits, **config)
        self.conversations = ConversationStore(self.config.max_stored_responses, self.config.max_stored_chars)
        self.metrics = ServerMetrics("served")
        models = serving_loaded(self.engine, self.tokenizer, "model", alias="served")
        self.service = GenerationService(models, self.config, self.conversations, self.metrics)
        self.updates: list[str] = []  # the status of each stream the service told about, in order

    async def start(self, body: dict[str, Any], owner: str = "conn_1", wire: WireFormat = RESPONSES_WEBSOCKET
                    ) -> GenerationStream:
        request = parse_request(body, wire, self.config.limits)
        return await self.service.start(request, owner, lambda stream: self.updates.append(stream.status))

    async def refused(self, body: dict[str, Any], owner: str = "conn_1", wire: WireFormat = RESPONSES_WEBSOCKET
                      ) -> tuple[str, str | None, int]:
        submitted = len(self.engine.submissions)
        with pytest.raises(ProtocolError) as raised:
            await self.start(body, owner, wire)
        assert len(self.engine.submissions) == submitted  # nothing reached the engine
        return raised.value.code, raised.value.param, raised.value.status

    async def finish(self, stream: GenerationStream, text: str, reason: str = "stop") -> None:
        """The engine ends `stream`'s request with `text` (one token per character)."""
        submission = next(s for s in self.engine.submissions if s.request_id == stream.response_id)
        self.engine.answer(submission, [text], len(text), finished=True, reason=reason)
        await settled()

    def observed(self, histogram: str) -> float:
        return self.metrics.registry.get_sample_value(f"localserve_{histogram}_count", {"model_name": "served"})


async def settled() -> None:
    """Let the outputs the engine thread handed over (call_soon_threadsafe) reach the service."""
    await asyncio.sleep(0)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


# ------------------------------------------------------------------ previous_response_id
def test_a_stored_response_is_continued_from_any_connection_with_its_reply():
    async def main():
        served = Served()
        first = await served.start({"input": "abc", "instructions": "sys"})
        await served.finish(first, "def")
        second = await served.start({"input": "gh", "previous_response_id": first.response_id}, owner="conn_2")
        return served, second

    served, second = run(main())
    messages, add_generation_prompt = served.tokenizer.rendered[-1]
    assert messages == [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "def"},
                        {"role": "user", "content": "gh"}]  # the instructions are not carried over
    assert add_generation_prompt and second.num_prompt_tokens == 8


def test_an_unknown_previous_response_is_not_found():
    served = Served()
    assert run(served.refused({"input": "x", "previous_response_id": "resp_nope"})) == (
        "previous_response_not_found", "previous_response_id", 400)


def test_a_store_false_response_is_continued_by_its_connection_alone_until_it_ends():
    async def main():
        served = Served()
        private = await served.start({"input": "abc", "store": False}, owner="conn_1")
        await served.finish(private, "def")
        follow_up = {"input": "x", "previous_response_id": private.response_id}
        refused = await served.refused(follow_up, owner="conn_2")
        await served.start(follow_up, owner="conn_1")
        served.service.end_owner("conn_1")
        gone = await served.refused(follow_up, owner="conn_1")
        return refused, gone

    refused, gone = run(main())
    assert refused == gone == ("previous_response_not_found", "previous_response_id", 400)


# ------------------------------------------------------------------ bounds that need the conversation or the prompt
def test_the_conversation_bound_counts_history_input_and_instructions_at_the_limit_and_one_past():
    async def main():
        served = Served()
        first = await served.start({"input": "abcde"})
        await served.finish(first, "fghij")  # 10 characters kept
        turn = {"previous_response_id": first.response_id}
        await served.start({**turn, "input": "x" * 10})  # 20: the limit
        await served.start({**turn, "input": "x" * 9, "instructions": "y"})
        past = await served.refused({**turn, "input": "x" * 11})
        past_with_instructions = await served.refused({**turn, "input": "x" * 10, "instructions": "y"})
        return past, past_with_instructions

    assert run(main()) == (("string_above_max_length", "input", 400),) * 2


def test_the_conversation_bound_names_the_field_as_the_format_spells_it():
    served = Served(limits=RequestLimits(max_conversation_chars=20, max_input_chars=100))
    run(served.start({"messages": [{"role": "user", "content": "x" * 20}]}, wire=CHAT_COMPLETIONS))
    assert run(served.refused({"messages": [{"role": "user", "content": "x" * 21}]}, wire=CHAT_COMPLETIONS)) == (
        "string_above_max_length", "messages", 400)


def test_a_prompt_that_fills_the_context_is_refused_and_one_token_shorter_gets_one_token():
    served = Served(max_model_len=50, limits=RequestLimits())
    assert run(served.refused({"input": "x" * 50})) == ("context_length_exceeded", "input", 400)
    stream = run(served.start({"input": "x" * 49}))
    assert stream.num_prompt_tokens == 49 and served.engine.submissions[-1].params.max_tokens == 1


@pytest.mark.parametrize("max_output_tokens, default, expected", [
    (50, 1024, 20), (21, 1024, 20), (20, 1024, 20), (19, 1024, 19), (None, 1024, 20), (None, 5, 5),
])
def test_max_tokens_are_cut_to_the_room_the_context_leaves(max_output_tokens, default, expected):
    served = Served(max_model_len=50, limits=RequestLimits(), default_max_output_tokens=default)
    body = {"input": "x" * 30} | ({"max_output_tokens": max_output_tokens} if max_output_tokens else {})
    run(served.start(body))
    assert served.engine.submissions[-1].params.max_tokens == expected


@pytest.mark.parametrize("wire, body, param", [
    (RESPONSES_HTTP, {"input": "x", "max_output_tokens": 51}, "max_output_tokens"),
    (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 51}, "max_tokens"),
    (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 51},
     "max_completion_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 51}, "max_tokens"),
])
def test_max_tokens_above_the_context_are_refused_naming_the_field_as_sent(wire, body, param):
    served = Served(max_model_len=50, limits=RequestLimits())
    assert run(served.refused(body, wire=wire)) == ("integer_above_max_value", param, 400)
    run(served.start(body | {param: 50}, wire=wire))  # the context length itself is allowed, then cut
    assert served.engine.submissions[-1].params.max_tokens == 49


@pytest.mark.parametrize("max_model_len, body, accepted", [
    (100, {"max_output_tokens": 12}, True), (100, {"max_output_tokens": 13}, False),  # 1 x 1 x tokens
    (100, {"max_output_tokens": 2, "top_logprobs": 2, "localserve": {"n": 2}}, True),  # 3 x 2 x 2 = 12
    (100, {"max_output_tokens": 3, "top_logprobs": 2, "localserve": {"n": 2}}, False),  # 18
    (14, {"max_output_tokens": 14}, True),  # counted after the cut: "hi" leaves room for 12 tokens
    (15, {"max_output_tokens": 14}, False),  # room for 13
])
def test_the_log_probabilities_are_bounded_in_entries_at_the_limit_and_one_past(max_model_len, body, accepted):
    served = Served(max_model_len=max_model_len)
    body = {"input": "hi", "include": ["message.output_text.logprobs"]} | body
    if accepted:
        run(served.start(body))
        assert served.engine.submissions[-1].params.logprobs == body.get("top_logprobs", 0)
    else:
        assert run(served.refused(body)) == ("invalid_value", "max_output_tokens", 400)


def test_a_warm_up_prefills_the_input_with_one_hidden_token_and_no_generation_prompt():
    served = Served(limits=RequestLimits())
    run(served.start({"input": "abc", "generate": False, "max_output_tokens": 40}))
    assert served.engine.submissions[-1].params.max_tokens == 1
    assert served.tokenizer.rendered[-1] == ([{"role": "user", "content": "abc"}], False)


def test_a_text_completion_is_tokenized_as_it_is():
    served = Served(limits=RequestLimits())
    run(served.start({"prompt": "once upon", "max_tokens": 3}, wire=COMPLETIONS))
    assert served.tokenizer.encoded == ["once upon"] and served.tokenizer.rendered == []
    assert len(served.engine.submissions[-1].prompt_token_ids) == 9


# ------------------------------------------------------------------ what can stop a response before the engine
def test_max_running_responses_run_and_one_more_is_a_429_until_one_ends():
    async def main():
        served = Served(max_running_responses=2)
        first = await served.start({"input": "a"})
        await served.start({"input": "b"})
        busy = await served.refused({"input": "c"})
        await served.finish(first, "done")
        await served.start({"input": "c"})
        return busy, served.service.num_running

    busy, num_running = run(main())
    assert busy == ("server_busy", None, 429) and num_running == 2


def test_what_the_engine_refuses_and_an_unknown_model_are_errors_and_nothing_runs():
    served = Served()
    served.engine.refusal = "the request can never be admitted"
    with pytest.raises(ProtocolError) as raised:
        run(served.start({"input": "a"}))
    assert (raised.value.code, raised.value.message) == ("invalid_request", "the request can never be admitted")
    assert served.service.num_running == 0
    served.engine.refusal = None
    assert run(served.refused({"input": "a", "model": "gpt-4o"})) == ("model_not_found", "model", 404)


class FailingTokenizer(CountingTokenizer):
    def encode_chat(self, messages, add_generation_prompt=True):
        raise KeyError("no chat template")


def test_a_prompt_that_cannot_be_rendered_or_is_empty_is_an_invalid_prompt():
    served = Served()
    assert run(served.refused({"input": [{"role": "user", "content": ""}]})) == ("invalid_prompt", "input", 400)
    assert run(served.refused({"prompt": "", "max_tokens": 1}, wire=COMPLETIONS)) == ("invalid_prompt", "prompt", 400)
    served = Served(tokenizer=FailingTokenizer())
    with pytest.raises(ProtocolError) as raised:
        run(served.start({"input": "a"}))
    assert raised.value.code == "invalid_prompt" and "KeyError" in raised.value.message


# ------------------------------------------------------------------ ending
def test_a_response_that_ends_is_stored_with_its_reply_and_frees_its_slot():
    async def main():
        served = Served()
        stream = await served.start({"input": "abc"})
        submission = served.engine.submissions[-1]
        served.engine.answer(submission, ["de"], 2)
        await settled()
        served.engine.answer(submission, ["f"], 3, finished=True, reason="stop")
        await settled()
        return served, stream

    served, stream = run(main())
    assert served.updates == ["in_progress", "completed"] and stream.texts == ["def"]
    assert served.conversations.get(stream.response_id, "conn_9") == [{"role": "user", "content": "abc"},
                                                                      {"role": "assistant", "content": "def"}]
    assert served.engine.aborted == [] and served.service.num_running == 0


def test_a_failed_response_is_not_stored():
    async def main():
        served = Served()
        stream = await served.start({"input": "abc"})
        served.engine.answer(served.engine.submissions[-1], [], 0, finished=True, error="boom")
        await settled()
        return served, stream

    served, stream = run(main())
    assert stream.status == "failed" and served.updates == ["failed"]
    assert served.conversations.get(stream.response_id, "conn_1") is None and served.service.num_running == 0


@pytest.mark.parametrize("stop, status, stored", [
    ("cancel", "cancelled", True), ("abandon", "cancelled", False), ("shut_down", "incomplete", False),
])
def test_cancel_abandon_and_shut_down_free_the_blocks_and_store_as_documented(stop, status, stored):
    async def main():
        served = Served()
        stream = await served.start({"input": "abc"})
        submission = served.engine.submissions[-1]
        served.engine.answer(submission, ["so far"], 2)
        await settled()
        getattr(served.service, stop)(stream)
        getattr(served.service, stop)(stream)  # twice: the second finds nothing to stop
        served.engine.answer(submission, [" late"], 3, finished=True, reason="abort")  # on its way: ignored
        await settled()
        return served, stream

    served, stream = run(main())
    assert served.engine.aborted == [stream.response_id]
    assert stream.status == status and stream.texts == ["so far"]
    assert served.updates == ["in_progress", status] and served.service.num_running == 0
    kept = served.conversations.get(stream.response_id, "conn_1")
    conversation = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "so far"}]
    assert kept == (conversation if stored else None)
    if stop == "shut_down":
        assert stream.incomplete_reason == "server_shutdown"


def test_latencies_are_observed_first_token_then_between_tokens_then_the_whole():
    async def main():
        served = Served()
        stream = await served.start({"input": "abc"})
        submission = served.engine.submissions[-1]
        served.engine.answer(submission, [""], 0)  # a prefill step without a token observes nothing
        await settled()
        assert (served.observed("time_to_first_token_seconds"), served.observed("inter_token_latency_seconds")) == (
            0, 0)
        for count, text in enumerate(["a", "b", "c"], start=1):
            served.engine.answer(submission, [text], count)
            await settled()
        assert served.observed("e2e_request_latency_seconds") == 0
        await served.finish(stream, "d")
        warm_up = await served.start({"input": "abc", "generate": False})
        await served.finish(warm_up, "x")  # its one token, which nobody sees, is no first token either
        return served

    served = run(main())
    assert served.observed("time_to_first_token_seconds") == 1
    assert served.observed("inter_token_latency_seconds") == 3  # b, c, d
    assert served.observed("e2e_request_latency_seconds") == 2  # the warm-up too; it has no first token
