"""The API-neutral stream of one generation: what every API's view reads (no I/O here).

`GenerationStream` absorbs the engine's outputs (on the event loop) into what any API shows of a running
response: each sample's `SampleOutput` (its answer text, reasoning and whole tool calls, its events not yet
sent, its log-probabilities, why it stopped), the response's status, its token counts and its times. It
knows no wire format: each API's view (server/openai/, server/ollama/, server/anthropic/) reads it and spells
its own events and objects; the Responses API's events are one such view (server/openai/responses_events.py).

Each sample's text goes through the chat format's stream parser (`parser`; None: plain text), which splits
it into reasoning, answer text and tool calls (server/generation/sample_output.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from localserve.engine.outputs import RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.server.generation.sample_output import SampleOutput, TokenLogprob
from localserve.server.request.generation_request import GenerationRequest
from localserve.server.request.validation import ProtocolError
from localserve.tokenizer.chat_format import ChatStreamParser


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: `resp_...`, `msg_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


TokenText = Callable[[int], str]
ParserFactory = Callable[[], ChatStreamParser]


class GenerationStream:
    """One response as the engine produces it, in no API's shape.

    `status` is "in_progress", then "completed" (every sample stopped), "incomplete" (a sample reached its
    token limit, or the server shut down: `incomplete_reason`), "cancelled" or "failed" (`error_message`).
    `parser` makes each sample's stream parser (None: plain text); `token_text` spells one token id, for
    log-probabilities.
    """

    def __init__(self, request: GenerationRequest, params: SamplingParams, response_id: str, model: str,
                 num_prompt_tokens: int, token_text: TokenText, parser: ParserFactory | None = None) -> None:
        self.request, self.params, self.response_id, self.model = request, params, response_id, model
        self.num_prompt_tokens = num_prompt_tokens
        self.token_text = token_text
        self.created_at = int(time.time())
        num_samples = params.n if request.generate else 0  # a warm-up answers with no output
        self.samples = [SampleOutput(parser() if parser is not None else None) for _ in range(num_samples)]
        self.parsed = parser is not None
        self.num_cached_tokens = 0
        # when the response began, its first output token came and it ended (time.monotonic)
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.status = "in_progress"  # -> completed | incomplete | cancelled | failed
        self.incomplete_reason = "max_output_tokens"  # or "server_shutdown"
        self.error_message: str | None = None

    @property
    def texts(self) -> list[str]:
        """Each sample's answer text (its content, without reasoning or calls)."""
        return [sample.content for sample in self.samples]

    @property
    def is_done(self) -> bool:
        """The engine is finished with this response (a view may still have to send its end)."""
        return self.status != "in_progress"

    @property
    def ended_normally(self) -> bool:
        """The engine finished every sample (a stop or the token limit): not failed, cancelled or shut down."""
        return self.status == "completed" or (self.status == "incomplete"
                                              and self.incomplete_reason != "server_shutdown")

    def ending_error(self) -> ProtocolError:
        """Why a response that did not end normally ended (over HTTP nothing else cancels a response)."""
        if self.status == "failed":
            return ProtocolError("server_error", f"the request failed: {self.error_message}",
                                 error_type="server_error", status=500)
        return ProtocolError("server_shutdown", "the server is shutting down", error_type="server_error",
                             status=503)

    @property
    def has_pending(self) -> bool:
        """A sample has events or log-probabilities no view has taken yet."""
        return any(sample.has_pending for sample in self.samples)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, every sample."""
        return sum(sample.num_output_tokens for sample in self.samples)

    @property
    def num_reasoning_tokens(self) -> int:
        """Output tokens inside reasoning blocks, every sample."""
        return sum(sample.num_reasoning_tokens for sample in self.samples if self.parsed)

    def absorb(self, output: RequestOutput) -> None:
        """Take one engine output: new text (and logprobs), and the outcome once finished."""
        if self.is_done:  # cancelled while this output was on its way
            return
        self.num_cached_tokens = output.num_cached_tokens
        for completion in output.outputs[:len(self.samples)]:
            sample = self.samples[completion.index]
            sample.feed(completion.delta_text)
            sample.num_output_tokens = len(completion.token_ids)
            sample.num_reasoning_tokens = completion.num_reasoning_tokens
            sample.finish_reason, sample.stop = completion.finish_reason, completion.stop
            if completion.delta_token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            if self.params.logprobs is not None and completion.delta_token_ids:
                first = len(completion.token_ids) - len(completion.delta_token_ids)
                for offset, token_id in enumerate(completion.delta_token_ids):
                    position = first + offset
                    top = completion.top_logprobs[position] if len(completion.top_logprobs) > position else []
                    sample.add_logprob(TokenLogprob(
                        self.token_text(token_id), completion.logprobs[position],
                        tuple((self.token_text(top_id), top_logprob) for top_id, top_logprob in top)))
            if completion.finish_reason is not None:
                sample.finish()
        if output.error:
            self.fail(output.error)
        elif output.finished:
            self.status = "incomplete" if any(s.finish_reason == "length" for s in self.samples) else "completed"
            self.finished_at = time.monotonic()

    def cancel(self) -> None:
        """The client cancelled: close with what was generated so far."""
        if not self.is_done:
            self._end("cancelled")

    def shut_down(self) -> None:
        """The server is stopping: close as incomplete (reason `server_shutdown`) with the text so far."""
        if not self.is_done:
            self.incomplete_reason = "server_shutdown"
            self._end("incomplete")

    def fail(self, message: str) -> None:
        """The engine failed this request."""
        if not self.is_done:
            self.error_message = message
            self._end("failed")

    def _end(self, status: str) -> None:
        for sample in self.samples:
            sample.finish()
        self.status, self.finished_at = status, time.monotonic()
