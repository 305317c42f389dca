"""Prefix reuse of a hybrid (linear-attention) model as a chat client sees it: a tiny random Qwen3.5 served
with its real template (Qwen3.5-4B.jinja) and vocabulary (ggml-vocab-qwen35, 151,936 tokens), the state
checkpoints at their default spacing, a ten-turn conversation through the `openai` SDK that resends the
whole history every turn. Each turn's `cached_tokens` is the boundary the cache can resume from, computed
here from the token ids the engine saw (the last checkpoint at or before the first token where the prompt
leaves an earlier sequence), and each answer is the one a server with prefix caching off gives. A prompt
sharing only part of a block with a cached one resumes from the boundary before it. A server that speculates
(drafts verified over the recurrent layers) answers and resumes each turn alike.

Checkpoints (kv/state_group.py): the state after every `state_checkpoint_tokens` tokens and at the last
boundary `PROMPT_TAIL` (8) tokens or more before a prompt's end. A turn's prompt leaves the previous one
where the previous generation prompt began (`<think>\\n\\n</think>\\n\\n`, four tokens, is not how the template
renders a past answer), which lies past that checkpoint: every turn resumes from the previous prompt's.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from localserve.engine.config import STATE_CHECKPOINT_TOKENS
from localserve.engine.engine_thread import EngineThread
from localserve.kv.state_group import PROMPT_TAIL
from tests.helpers.chat_families import family_tokenizer
from tests.helpers.hybrid_models import BLOCK_SIZE
from tests.helpers.oracle_drafter import OracleDrafter
from tests.helpers.qwen35_serving import QWEN35_VOCAB, serve_qwen35, write_tiny_qwen35
from tests.helpers.server import openai_client
from tests.helpers.spec_costs import FixedStepCost

ANSWER_TOKENS = 10
TURNS = 10
SYSTEM = "You are a patient guide to the countryside. Answer in short sentences and ask one question back."
WORDS = "the river runs past the old mill where we talked about stars, trains and the price of bread".split()


class SeenEngineThread(EngineThread):
    """Keeps every request's prompt ids and, once it finishes, its output ids (in submission order); counts
    the prompt tokens its engine has prefilled."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.seen: list[dict] = []
        engine.seen_thread = self

    def prefilled(self) -> int:
        """Prompt tokens computed so far, every step (read between two steps)."""
        return self.call(lambda engine: sum(step.num_prefill_tokens for step in engine.step_history)).result(30)

    def submit(self, prompt_token_ids, params, on_output, request_id=None):
        record = {"prompt": list(prompt_token_ids), "output": None}
        self.seen.append(record)

        def keep(output):
            if output.finished:
                record["output"] = list(output.outputs[0].token_ids)
            on_output(output)

        return super().submit(prompt_token_ids, params, keep, request_id)


def checkpoints(prompt: list[int], output: list[int], interval: int = STATE_CHECKPOINT_TOKENS) -> set[int]:
    """The boundaries whose states a finished sequence left in the cache: every `interval` tokens of what
    was computed (all but the last output token) and the last boundary `PROMPT_TAIL` tokens or more before
    its prompt's end (what a template re-renders of a generation prompt lies after it)."""
    computed = len(prompt) + max(len(output) - 1, 0)
    end = max(0, len(prompt) - PROMPT_TAIL) // BLOCK_SIZE * BLOCK_SIZE
    return set(range(interval, computed + 1, interval)) | ({end} - {0})


def shared_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_cached(prompt: list[int], earlier: list[dict]) -> int:
    """The longest checkpointed boundary of an earlier sequence that `prompt` shares, leaving one token to
    compute."""
    best = 0
    for record in earlier:
        tokens = record["prompt"] + record["output"]
        reach = min(shared_length(prompt, tokens), len(prompt) - 1)
        best = max([best, *(b for b in checkpoints(record["prompt"], record["output"]) if b <= reach)])
    return best


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen35(tmp_path_factory.mktemp("qwen35-reuse"))


@contextmanager
def serve(folder, **config):
    """A server of the tiny Qwen3.5 (served as "qwen3.5", its real template and vocabulary) on a recording
    engine thread; yields (server, that thread)."""
    with serve_qwen35(folder, engine_thread_type=SeenEngineThread, **config) as server:
        yield server, server.server.models.serving_now().engine  # the engine thread


def chat(client, messages: list[dict]):
    return client.chat.completions.create(model="qwen3.5", messages=messages, temperature=0,
                                          max_tokens=ANSWER_TOKENS, reasoning_effort="none")


def user_message(turn: int) -> str:
    """Turn `turn`'s question: lengths vary so that the prompts end at different places in their blocks."""
    return f"Turn {turn}: " + " ".join(WORDS[: 3 + (turn * 5) % len(WORDS)]) + "?"


@pytest.fixture(scope="module")
def conversation(folder):
    """The ten turns sent to a server with the cache on, and each turn's request to one with it off:
    (answers on, answers off, what the cached server's engine saw, the clients, the prompt tokens its engine
    computed for each turn)."""
    messages, on, off, prefilled = [{"role": "system", "content": SYSTEM}], [], [], []
    with serve(folder) as (cached_server, seen), serve(folder, enable_prefix_caching=False) as (plain_server, _), \
            openai_client(cached_server.port) as cached_client, openai_client(plain_server.port) as plain_client:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": user_message(turn)})
            before = seen.prefilled()
            on.append(chat(cached_client, messages))
            prefilled.append(seen.prefilled() - before)
            off.append(chat(plain_client, messages))
            messages.append({"role": "assistant", "content": on[-1].choices[0].message.content})
        yield on, off, seen.seen, cached_client, plain_client, prefilled


def test_each_turn_resumes_from_the_last_checkpoint_it_shares(conversation):
    on, off, seen, *_, prefilled = conversation
    assert [len(record["prompt"]) for record in seen] == [answer.usage.prompt_tokens for answer in on]
    assert on[0].usage.prompt_tokens_details.cached_tokens == 0
    assert prefilled[0] == len(seen[0]["prompt"])
    resumed_from_previous = 0
    for turn in range(1, TURNS):
        prompt, previous = seen[turn]["prompt"], seen[turn - 1]["prompt"]
        expected = expected_cached(prompt, seen[:turn])
        cached = on[turn].usage.prompt_tokens_details.cached_tokens
        assert cached == expected, f"turn {turn}"
        assert cached > 0 and cached % BLOCK_SIZE == 0, f"turn {turn}"
        assert prefilled[turn] == len(prompt) - cached, f"turn {turn}"  # what the engine computed
        # Only the tokens past the previous prompt's end checkpoint are prefilled: the template re-renders
        # the previous generation prompt (its last 4 tokens), which lies past that checkpoint.
        resumed_from_previous += cached >= (len(previous) - PROMPT_TAIL) // BLOCK_SIZE * BLOCK_SIZE
    assert resumed_from_previous == TURNS - 1


def test_answers_equal_the_cache_off_servers(conversation):
    on, off, *_ = conversation
    for turn, (with_cache, without) in enumerate(zip(on, off)):
        assert without.usage.prompt_tokens_details.cached_tokens == 0
        assert with_cache.usage.prompt_tokens == without.usage.prompt_tokens, f"turn {turn}"
        assert with_cache.choices[0].message.content == without.choices[0].message.content, f"turn {turn}"
        assert with_cache.usage.completion_tokens == without.usage.completion_tokens == ANSWER_TOKENS


def test_a_prompt_sharing_part_of_a_block_resumes_from_the_boundary_before_it(conversation):
    on, off, seen, cached_client, plain_client, _ = conversation
    last = seen[TURNS - 1]["prompt"]
    boundary = (len(last) - PROMPT_TAIL) // BLOCK_SIZE * BLOCK_SIZE  # the last prompt's end checkpoint
    assert boundary + 7 < len(last)
    # The last prompt's text up to 7 tokens into the block after its last checkpoint, then other words.
    text = family_tokenizer("qwen3.5").decode(last[:boundary + 7], skip_special_tokens=False)
    kwargs = {"model": "qwen3.5", "prompt": text + " zebra quartz lantern", "temperature": 0, "max_tokens": 6}
    reused, plain = cached_client.completions.create(**kwargs), plain_client.completions.create(**kwargs)
    prompt = seen[-1]["prompt"]
    assert boundary < shared_length(prompt, last) < boundary + BLOCK_SIZE  # part of the block after it
    assert reused.usage.prompt_tokens_details.cached_tokens == boundary == expected_cached(prompt, seen[:TURNS])
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    assert reused.choices[0].text == plain.choices[0].text


@pytest.fixture(scope="module")
def speculated(folder, conversation):
    """The same ten turns sent to a server that speculates (the cache on): its drafter drafts each turn's
    known answer with planted wrong tokens (tests/helpers/oracle_drafter.py), so drafts are kept whole, cut
    and rejected over the recurrent layers. (its answers, the cached server's, the speculation totals)"""
    on, _, seen, *_ = conversation
    oracle = OracleDrafter([record["prompt"] + record["output"] for record in seen], QWEN35_VOCAB, seed=1)

    def install(engine):
        engine.scheduler.speculation.drafter = oracle
        engine.scheduler.speculation.cost = FixedStepCost()  # drafts whatever this machine's speed

    messages, answers = [{"role": "system", "content": SYSTEM}], []
    with serve(folder, spec_type="ngram", spec_tokens=4) as (server, thread), openai_client(server.port) as client:
        thread.call(install).result(30)
        for turn in range(TURNS):
            messages.append({"role": "user", "content": user_message(turn)})
            answers.append(chat(client, messages))
            messages.append({"role": "assistant", "content": on[turn].choices[0].message.content})
        totals = thread.call(lambda engine: engine.scheduler.speculation.totals).result(30)
    return answers, on, totals


def test_speculated_turns_answer_and_resume_as_without_speculation(speculated):
    """Drafts verified over the recurrent layers change no answer and no checkpoint a later turn resumes
    from: each turn's text and cached tokens are the non-speculating server's."""
    answers, on, totals = speculated
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    for turn, (answer, plain) in enumerate(zip(answers, on)):
        assert answer.choices[0].message.content == plain.choices[0].message.content, f"turn {turn}"
        assert answer.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens_details.cached_tokens
