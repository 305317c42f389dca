"""Stop rules on a scripted model (tests/helpers/scripted.py), whose output is a script of token texts:
stop strings at every kind of boundary, what is streamed before them, and each finish reason.

The reference for a stop string is worked out from the script alone: the request stops at the first
token after which the text holds a stop string; the text ends where the first stop string to be
completed (the longest, when two are completed at the same character) begins.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.engine import engine as engine_module
from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.outputs import StopReason
from localserve.engine.sampling_params import SamplingParams
from localserve.llm import LLM
from tests.helpers.scripted import EOS, decoded_prefix, write_scripted_model

HELLO = ["Hel", "lo", " wor", "ld", "!", " Bye"]  # then EOS


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """scripted(pieces, **options) -> (LLM, Script) for a model that says `pieces`; cached per script."""
    cache: dict[tuple, tuple[LLM, object]] = {}

    def make(pieces, then="eos", generation_eos=None, max_model_len=None):
        key = (tuple(pieces), then, tuple(generation_eos or ()), max_model_len)
        if key not in cache:
            script = write_scripted_model(tmp_path_factory.mktemp("scripted"), pieces, then, generation_eos)
            config = EngineConfig(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                                  max_model_len=max_model_len, check_integrity=True)
            cache[key] = (LLM(str(script.folder), device="cpu", engine_config=config), script)
        return cache[key]

    return make


def run_streaming(llm: LLM, prompt: list[int], params: SamplingParams):
    """Step the engine to the end of one request; returns its final output and each step's output."""
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps += [out for out in engine.step() if out.request_id == request_id]
    assert steps[-1].finished and engine.is_idle_and_clean()
    return steps[-1], steps


def expected_stop(pieces, stops) -> tuple[int, str]:
    """(tokens generated, text) for a script that hits one of `stops`, worked out from the script."""
    for count in range(1, len(pieces) + 1):
        text = decoded_prefix(pieces, count)
        found = [(text.find(s) + len(s), -len(s), text.find(s)) for s in stops if s in text]
        if found:
            return count, text[:min(found)[2]]
    raise AssertionError("the script never completes a stop string")


def assert_streamed_safely(steps, pieces, stops) -> None:
    """Deltas only ever add to the final text, and hold back no more than a stop string could claim."""
    final_text = steps[-1].outputs[0].text
    shown = ""
    hold_back = max((len(s) for s in stops), default=1) - 1
    for step in steps:
        for output in step.outputs:
            assert "\ufffd" not in output.delta_text  # never half a character
        shown += step.outputs[0].delta_text
        assert final_text.startswith(shown)
        if not step.finished:
            text_so_far = decoded_prefix(pieces, len(step.outputs[0].token_ids))
            assert len(shown) >= len(text_so_far) - hold_back
    assert shown == final_text


STOP_CASES = {
    # name: (pieces, stop strings)
    "ends at a token boundary": (HELLO, [" wor"]),
    "spans two tokens, ends at a boundary": (HELLO, ["lo wor"]),
    "ends inside a token": (HELLO, ["wo"]),
    "across two tokens": (HELLO, ["o w"]),
    "across three tokens": (HELLO, ["lo world"]),
    "in the first token": (HELLO, ["He"]),
    "the last token before EOS": (HELLO, ["Bye"]),
    "the shorter one completes first": (["ab", "cd", "ef"], ["bcdef", "cd"]),
    "two in one token, earliest end wins": (["Hello world", "!"], ["world", "lo w"]),
    "two in one token, the other order": (["Hello world", "!"], ["lo w", "world"]),
    "one a suffix of the other": (["xabc", "d"], ["bc", "abc"]),
    "one a suffix of the other, reversed": (["xabc", "d"], ["abc", "bc"]),
    "one a prefix of the other": (["zab", "c"], ["abc", "ab"]),
    "a two-byte character over two tokens": (["caf", b"\xc3", b"\xa9", " au lait"], ["\u00e9"]),
    "a stop string with a split character in it": (["caf", b"\xc3", b"\xa9 au", " lait"], ["\u00e9 au l"]),
    "a four-byte emoji over three tokens": (["hi ", b"\xf0\x9f", b"\x98", b"\x80", " there"], ["\U0001F600 t"]),
    "at the start of a long token": (["Hi", "STOP" + "y" * 100, "z"], ["STOP"]),
    "in a long token after a held-back start": (["Hi S", "T" * 3 + "OP" + "y" * 90, "z"], ["STTTOP", "q" * 8]),
}


@pytest.mark.parametrize("name", STOP_CASES)
def test_stop_string_cuts_text_and_tokens_exactly(scripted, name):
    pieces, stops = STOP_CASES[name]
    llm, script = scripted(pieces)
    final, steps = run_streaming(llm, script.prompt, SamplingParams(temperature=0, max_tokens=50, stop=stops,
                                                                    logprobs=0))
    count, text = expected_stop(pieces, stops)
    output = final.outputs[0]
    assert (output.text, output.finish_reason) == (text, "stop")
    # The token that completed the stop string is the last one: nothing was generated after it.
    assert output.token_ids == script.piece_ids[:count]
    assert len(output.logprobs) == len(output.token_ids)
    decoded = llm.tokenizer.decode(output.token_ids)
    assert decoded.startswith(output.text) and any(decoded[len(output.text):].startswith(s) for s in stops)
    assert_streamed_safely(steps, pieces, stops)


def test_no_stop_string_found_streams_everything(scripted):
    llm, script = scripted(HELLO)
    params = SamplingParams(temperature=0, max_tokens=50, stop=["wxyz", "Hello!"])
    final, steps = run_streaming(llm, script.prompt, params)
    assert (final.text, final.outputs[0].finish_reason) == ("Hello world! Bye", "stop")
    assert final.token_ids == script.piece_ids + [EOS]
    assert_streamed_safely(steps, HELLO, ["wxyz", "Hello!"])


def test_stop_string_in_the_prompt_does_not_stop(scripted):
    llm, script = scripted(HELLO)
    prompt = script.prompt + script.piece_ids[:2]  # "Hello": the model goes on with " wor"
    final, _ = run_streaming(llm, prompt, SamplingParams(temperature=0, max_tokens=50, stop=["Hel"]))
    assert final.text == " world! Bye"


def test_parallel_samples_each_stop_at_their_stop_string(scripted):
    llm, script = scripted(HELLO)
    params = SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=50, stop=["o w"])
    final, steps = run_streaming(llm, script.prompt, params)
    for output in final.outputs:  # the script's successor carries all the probability: every sample follows it
        assert (output.text, output.token_ids, output.finish_reason) == ("Hell", script.piece_ids[:3], "stop")
    for index in range(3):
        assert "".join(s.outputs[index].delta_text for s in steps) == "Hell"


# ------------------------------------------------------------------ finish reasons
def piece(index: int) -> int:
    return 3 + index  # the scripted model numbers its pieces from 3 (after <unk>, <s>, </s>)


FINISH_CASES = {
    # name: (model options, params, expected number of tokens, expected finish reason)
    "EOS": ({}, {}, 7, "stop"),
    "EOS from generation_config": ({"then": "loop", "generation_eos": [EOS, piece(3)]}, {}, 4, "stop"),
    "a stop token id": ({}, {"stop_token_ids": [piece(2)]}, 3, "stop"),
    "ignore_eos runs to max_tokens": ({}, {"ignore_eos": True, "max_tokens": 10}, 10, "length"),
    "ignore_eos and a generation_config EOS": ({"then": "loop", "generation_eos": [EOS, piece(3)]},
                                               {"ignore_eos": True, "max_tokens": 9}, 9, "length"),
    "ignore_eos keeps stop token ids": ({}, {"ignore_eos": True, "stop_token_ids": [piece(1)]}, 2, "stop"),
    "ignore_eos keeps stop strings": ({}, {"ignore_eos": True, "stop": ["Hello w"]}, 3, "stop"),
    "max_tokens": ({}, {"max_tokens": 2}, 2, "length"),
    "EOS as the last allowed token": ({}, {"max_tokens": 7}, 7, "stop"),
    "a stop string at the last allowed token": ({}, {"max_tokens": 3, "stop": [" wor"]}, 3, "stop"),
    "a stop token id at the last allowed token": ({}, {"max_tokens": 3, "stop_token_ids": [piece(2)]}, 3, "stop"),
    "the context end": ({"then": "loop", "max_model_len": 6}, {"max_tokens": 5}, 5, "length"),
}


@pytest.mark.parametrize("name", FINISH_CASES)
def test_finish_reason(scripted, name):
    options, extra, count, reason = FINISH_CASES[name]
    llm, script = scripted(HELLO, **options)
    extra = dict(extra)  # the case stays whole for the next test that reads it
    params = SamplingParams(temperature=0, max_tokens=extra.pop("max_tokens", 50), **extra)
    final, steps = run_streaming(llm, script.prompt, params)
    output = final.outputs[0]
    # The script: the pieces, then EOS (or the pieces again), then the pieces again.
    cycle = script.piece_ids + ([EOS] if options.get("then", "eos") == "eos" else [])
    tokens = (cycle * 4)[:count]
    assert (output.token_ids, output.finish_reason) == (tokens, reason)
    # An end-of-sequence or stop token ends the text without adding its own; ignored, it is text.
    eos_ids = set() if params.ignore_eos else {EOS, *options.get("generation_eos", ())}
    stopping = eos_ids | set(params.stop_token_ids)
    shown = tokens[:-1] if reason == "stop" and tokens[-1] in stopping else tokens
    text = llm.tokenizer.decode(shown)
    if params.stop:
        text = text[:text.find(params.stop[0])]
    assert output.text == text
    assert "".join(step.outputs[0].delta_text for step in steps) == text
    assert len(script.prompt) + len(output.token_ids) <= llm.engine.max_model_len


def test_stop_strings_are_refused_where_no_text_is_made(scripted):
    llm, _ = scripted(HELLO)
    textless = build_engine(llm.engine.runner.model, None, EngineConfig(num_kv_blocks=8))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        textless.add_request([1], SamplingParams(max_tokens=4, stop=["lo"]))
    assert textless.is_idle_and_clean()
    with pytest.raises(ValueError, match="SamplingParams.stop .*beam_search"):
        SamplingParams(n=2, beam_search=True, stop=["lo"])


def test_special_tokens_show_in_the_text_when_not_skipped(scripted):
    """A chat format whose markers are special tokens (Mistral's [TOOL_CALLS]) reads them in the text."""
    llm, script = scripted(["Hel", "lo"])
    params = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 4}  # Hel lo </s> Hel
    shown, _ = run_streaming(llm, script.prompt, SamplingParams(**params, n=2, skip_special_tokens=False))
    skipped, _ = run_streaming(llm, script.prompt, SamplingParams(**params))
    assert shown.outputs[0].token_ids == skipped.outputs[0].token_ids == [*script.piece_ids, EOS, script.piece_ids[0]]
    assert [output.text for output in shown.outputs] == ["Hello</s>Hel"] * 2  # a parallel sample's own decoder too
    assert skipped.outputs[0].text == "HelloHel"


# ------------------------------------------------------------------ stop reasons
def first_stop_string(text: str, stops: list[str]) -> str | None:
    """The stop string that ends `text` first, reading it character by character (the longest of those
    completed at the same character); None if none is in it."""
    for end in range(1, len(text) + 1):
        completed = [stop for stop in stops if text.endswith(stop, 0, end)]
        if completed:
            return max(completed, key=len)
    return None


@pytest.mark.parametrize("name", STOP_CASES)
def test_stop_reason_names_the_stop_string_that_cut_the_text(scripted, name):
    pieces, stops = STOP_CASES[name]
    llm, script = scripted(pieces)
    final, _ = run_streaming(llm, script.prompt, SamplingParams(temperature=0, max_tokens=50, stop=stops))
    output = final.outputs[0]
    met = first_stop_string(decoded_prefix(pieces, len(pieces)), stops)
    assert output.stop == StopReason("stop_string", stop_string=met)
    assert llm.tokenizer.decode(output.token_ids)[len(output.text):].startswith(met)


STOP_REASONS = {  # FINISH_CASES' names: the stop reason each reports
    "EOS": StopReason("eos", EOS),
    "EOS from generation_config": StopReason("eos", piece(3)),
    "a stop token id": StopReason("stop_token", piece(2)),
    "ignore_eos runs to max_tokens": StopReason("length"),
    "ignore_eos and a generation_config EOS": StopReason("length"),
    "ignore_eos keeps stop token ids": StopReason("stop_token", piece(1)),
    "ignore_eos keeps stop strings": StopReason("stop_string", stop_string="Hello w"),
    "max_tokens": StopReason("length"),
    "EOS as the last allowed token": StopReason("eos", EOS),
    "a stop string at the last allowed token": StopReason("stop_string", stop_string=" wor"),
    "a stop token id at the last allowed token": StopReason("stop_token", piece(2)),
    "the context end": StopReason("length"),
}


@pytest.mark.parametrize("name", FINISH_CASES)
def test_stop_reason_of_each_finish(scripted, name):
    options, extra, _, reason = FINISH_CASES[name]
    llm, script = scripted(HELLO, **options)
    extra = dict(extra)  # the case stays whole for the next test that reads it
    params = SamplingParams(temperature=0, max_tokens=extra.pop("max_tokens", 50), **extra)
    final, _ = run_streaming(llm, script.prompt, params)
    output = final.outputs[0]
    assert output.stop == STOP_REASONS[name]
    assert output.stop.finish_reason == output.finish_reason == reason


@pytest.mark.parametrize(("ignore_eos", "expected"), [(False, StopReason("eos", EOS)),
                                                      (True, StopReason("stop_token", EOS))])
def test_an_end_of_sequence_token_asked_for_as_a_stop_token_is_reported_as_eos(scripted, ignore_eos, expected):
    llm, script = scripted(HELLO)
    params = SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[piece(4), EOS], ignore_eos=ignore_eos)
    final, _ = run_streaming(llm, script.prompt, params)
    assert final.outputs[0].stop == StopReason("stop_token", piece(4))  # the first to come ends it
    params = SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[EOS], ignore_eos=ignore_eos)
    final, _ = run_streaming(llm, script.prompt, params)
    assert final.outputs[0].stop == expected and final.outputs[0].token_ids[-1] == EOS


def test_each_parallel_sample_and_beam_reports_its_stop(scripted):
    llm, script = scripted(HELLO)
    final, _ = run_streaming(llm, script.prompt, SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=50,
                                                                stop=["xyz", "o w", "wor"]))
    assert [output.stop for output in final.outputs] == [StopReason("stop_string", stop_string="o w")] * 3
    beams, _ = run_streaming(llm, script.prompt, SamplingParams(n=2, beam_search=True, max_tokens=50))
    assert beams.outputs[0].stop == StopReason("eos", EOS) and beams.outputs[0].token_ids[-1] == EOS
    for output in beams.outputs:
        assert output.stop is not None and output.stop.finish_reason == output.finish_reason
    short, _ = run_streaming(llm, script.prompt, SamplingParams(n=2, beam_search=True, max_tokens=3))
    assert [output.stop for output in short.outputs] == [StopReason("length")] * 2


def test_an_aborted_request_reports_abort(scripted):
    llm, script = scripted(HELLO)
    engine = llm.engine
    request_id = engine.add_request(script.prompt, SamplingParams(temperature=0, max_tokens=50, n=2))
    engine.step()
    engine.step()
    final = engine.abort_request(request_id)
    assert final.finished and [output.stop for output in final.outputs] == [StopReason("abort")] * 2
    assert [output.finish_reason for output in final.outputs] == ["abort"] * 2
    assert engine.abort_request(request_id) is None and engine.is_idle_and_clean()


def test_a_request_that_fails_alone_reports_error(scripted, monkeypatch):
    llm, script = scripted(HELLO)
    engine = llm.engine
    real = engine_module.append_sampled_token

    def failing(request, seq, token_id, *rest):
        if request.request_id == "doomed" and seq.num_output_tokens == 2:
            raise RuntimeError("bookkeeping broke")
        return real(request, seq, token_id, *rest)

    monkeypatch.setattr(engine_module, "append_sampled_token", failing)
    params = SamplingParams(temperature=0, max_tokens=50)
    engine.add_request(script.prompt, params, "doomed")
    engine.add_request(script.prompt, params, "fine")
    final = engine.run_to_completion()
    assert final["doomed"].error and final["doomed"].outputs[0].stop == StopReason("error")
    assert final["fine"].outputs[0].stop == StopReason("eos", EOS) and engine.is_idle_and_clean()


def test_a_stop_reason_names_a_known_kind():
    with pytest.raises(ValueError, match="StopReason.kind must be one of eos, stop_token, .*'tool'"):
        StopReason("tool")


# A text full of overlapping repeats, in pieces of every size: "abracadabracadabracadabra", then EOS.
ABRA = ["ab", "ra", "cad", "a", "bra", "ca", "dab", "r", "aca", "d", "abra"]


@settings(max_examples=60, deadline=None)
@given(stops=st.lists(st.text("abcdr", min_size=1, max_size=6), min_size=1, max_size=4, unique=True),
       start=st.integers(0, len(ABRA) - 1))
def test_the_reported_stop_string_is_the_one_that_ends_the_text_where_it_was_cut(scripted, stops, start):
    """Generated stop strings over a text of overlapping repeats, the generation starting at any piece: the
    reported stop string is the one completed first (character by character), and the text the engine cut
    is followed, in the decoded output, by exactly that string."""
    llm, script = scripted(ABRA)
    final, _ = run_streaming(llm, script.prompt + script.piece_ids[:start],
                             SamplingParams(temperature=0, max_tokens=50, stop=stops))
    output = final.outputs[0]
    met = first_stop_string("".join(ABRA[start:]), stops)
    if met is None:
        assert output.stop == StopReason("eos", EOS) and output.text == "".join(ABRA[start:])
        return
    assert output.stop == StopReason("stop_string", stop_string=met)
    decoded = llm.tokenizer.decode(output.token_ids)
    assert decoded[len(output.text):].startswith(met)
    assert first_stop_string(output.text + met, stops) == met  # nothing in the kept text completed one before
