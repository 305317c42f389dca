"""The engine thread as the server sees it (`EngineAccess`, server/registry/engine_access.py), played by a
test: no engine behind it. Submissions and aborts are recorded; the test answers a submission itself, calling its
`on_output` with the outputs it chooses (`RecordedEngineThread.answer`). Statistics and snapshots are an
idle engine's. `CountingTokenizer` makes a prompt exactly as many tokens as its text has characters, so
a test sizes the prompt by its text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from localserve.engine.outputs import CompletionOutput, RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.snapshot import Counters, EngineSnapshot, EngineStats, Gauges
from tests.helpers.server import engine_facts

IDLE_STATS = EngineStats(Gauges(0, 0, 0, 0.0, 64, 0, 0, 0, 0.0, 0), Counters(*[0] * 13))


@dataclass
class Submission:
    """One `submit` call as the server made it."""

    prompt_token_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    request_id: str


class RecordedEngineThread:
    """Records what the server submits and aborts; `refusal`: the ValueError message submit raises."""

    last_event_seq = 0

    def __init__(self, max_model_len: int = 512) -> None:
        self.facts = engine_facts(max_model_len=max_model_len)
        self.submissions: list[Submission] = []
        self.aborted: list[str] = []
        self.refusal: str | None = None

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
               request_id: str | None = None) -> str:
        if self.refusal is not None:
            raise ValueError(self.refusal)
        self.submissions.append(Submission(list(prompt_token_ids), params, on_output, request_id))
        return request_id

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> Future[EngineStats]:
        return _done(IDLE_STATS)

    def snapshot_and_events(self, after_seq: int) -> Future[tuple[EngineSnapshot, list, int]]:
        return _done((EngineSnapshot(0.0, "." * 64, "", [], IDLE_STATS, after_seq), [], 0))

    def answer(self, submission: Submission, texts: Sequence[str], num_tokens: int, finished: bool = False,
               reason: str | None = None, error: str | None = None) -> None:
        """One engine output for `submission`: each sample adds its text of `texts` and now holds
        `num_tokens` tokens; `reason` is every sample's finish reason once `finished`."""
        outputs = [CompletionOutput(index, "", list(range(num_tokens)), None, reason if finished else None,
                                    delta_text=text, delta_token_ids=[num_tokens - 1] if text else [])
                   for index, text in enumerate(texts)]
        submission.on_output(RequestOutput(submission.request_id, submission.prompt_token_ids, outputs, finished,
                                           error=error))


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class CountingTokenizer:
    """One token per character of the content rendered; records every rendering it is asked for."""

    def __init__(self) -> None:
        self.rendered: list[tuple[list[dict[str, str]], bool]] = []  # (messages, add_generation_prompt)
        self.encoded: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append(text)
        return [ord(char) % 200 for char in text]

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        self.rendered.append(([dict(message) for message in messages], add_generation_prompt))
        return [ord(char) % 200 for message in messages for char in message["content"]]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{token_id}>" for token_id in ids)
