"""Running one response, whatever the transport: from a checked `ResponseRequest` to a `ResponseStream`.

`ResponseService.start` resolves `previous_response_id` (scoped to the asking connection for
`store: false` responses), renders and tokenizes the conversation off the event loop, applies the
server's defaults and the bounds that need the prompt's length (the context, the size of the
log-probabilities), submits to the engine thread, and absorbs the engine's outputs into the stream on
the event loop, calling the transport's `on_update` after each. When the response ends, its
conversation is stored for the next turn. The websocket session is one transport; an HTTP endpoint
can be another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localserve.engine.outputs import RequestOutput
from localserve.server.requests import ResponseRequest
from localserve.server.response_events import ResponseStream, new_id
from localserve.server.validation import ProtocolError

if TYPE_CHECKING:
    from localserve.server.context import ServerState

OnUpdate = Callable[[ResponseStream], None]


@dataclass
class _Run:
    """A response between submission and its end: what storing and metrics need."""

    stream: ResponseStream
    conversation: list[dict[str, str]]  # the messages to store with the reply
    owner: str  # the connection that asked
    on_update: OnUpdate
    arrival_time: float
    last_token_time: float | None = None


class ResponseService:
    """Starts, cancels and ends responses for every transport of one server."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._runs: dict[str, _Run] = {}  # by response id, until the response ends

    @property
    def num_running(self) -> int:
        return len(self._runs)

    async def start(self, request: ResponseRequest, owner: str, on_update: OnUpdate) -> ResponseStream:
        """Submit `request` for connection `owner`; raises ProtocolError if it cannot run."""
        state = self.state
        state.check_model(request.model)
        history: list[dict[str, str]] = []
        if request.previous_response_id is not None:
            found = state.conversations.get(request.previous_response_id, owner)
            if found is None:
                raise ProtocolError("previous_response_not_found", f"previous response "
                                    f"{request.previous_response_id!r} is not available here (unknown, "
                                    "evicted, or a store: false response of another connection); send the "
                                    "whole conversation instead", "previous_response_id")
            history = found
        conversation = history + request.input_messages
        limit = state.config.limits.max_conversation_chars
        num_chars = sum(len(message["content"]) for message in conversation) + len(request.instructions or "")
        if num_chars > limit:
            raise ProtocolError("string_above_max_length", f"the conversation holds {num_chars} characters; at "
                                f"most {limit} are accepted: start a new one", "input")
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        # A warm-up renders no assistant header, so a later turn's prompt begins with exactly its tokens.
        prompt_ids = await self._encode_chat(system + conversation, add_generation_prompt=request.generate)
        defaults = state.config.sampling_defaults  # each field the request leaves out
        if request.temperature is None:
            request.temperature = defaults.temperature
        if request.top_p is None:
            request.top_p = defaults.top_p
        request.extension = {"top_k": defaults.top_k, "min_p": defaults.min_p} | request.extension
        max_tokens = self._max_tokens(request, len(prompt_ids))
        params = request.sampling_params(max_tokens)
        stream = ResponseStream(request, new_id("resp"), state.served_name, len(prompt_ids), state.token_text)
        run = _Run(stream, conversation, owner, on_update, time.monotonic())
        loop = asyncio.get_running_loop()
        try:
            state.engine_thread.submit(prompt_ids, params,
                                       lambda output: loop.call_soon_threadsafe(self._on_output, run, output),
                                       request_id=stream.response_id)
        except ValueError as exc:
            raise ProtocolError("invalid_request", str(exc)) from None
        self._runs[stream.response_id] = run
        return stream

    def cancel(self, stream: ResponseStream) -> None:
        """The client cancelled: its blocks go back at once; the response ends with its text so far."""
        self._stop(stream, ResponseStream.cancel, store=True)

    def abandon(self, stream: ResponseStream) -> None:
        """The client went away: stop the response, store nothing."""
        self._stop(stream, ResponseStream.cancel, store=False)

    def shut_down(self, stream: ResponseStream) -> None:
        """The server is stopping: the response ends incomplete (reason `server_shutdown`)."""
        self._stop(stream, ResponseStream.shut_down, store=False)

    def _stop(self, stream: ResponseStream, end: Callable[[ResponseStream], None], store: bool) -> None:
        run = self._runs.pop(stream.response_id, None)
        if run is None:
            return
        self.state.engine_thread.abort(stream.response_id)
        end(stream)
        if store:
            self._store(run)
        run.on_update(stream)

    async def _encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        tokenizer = self.state.tokenizer
        try:  # rendering and tokenizing a long prompt must not hold up the other connections
            prompt_ids = await asyncio.to_thread(tokenizer.encode_chat, messages, add_generation_prompt)
        except Exception as exc:  # no chat template, a template that raised, a tokenizer that refused
            raise ProtocolError("invalid_prompt", f"the chat template could not render the input: "
                                f"{type(exc).__name__}: {str(exc)[:300]}", "input") from None
        if not prompt_ids:
            raise ProtocolError("invalid_prompt", "the input renders to an empty prompt", "input")
        return prompt_ids

    def _max_tokens(self, request: ResponseRequest, num_prompt_tokens: int) -> int:
        """max_output_tokens, cut to what the context has room for after the prompt; bounds checked."""
        max_model_len = self.state.engine_thread.engine.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise ProtocolError("context_length_exceeded", f"the prompt is {num_prompt_tokens} tokens; the "
                                f"context holds {max_model_len}, and generating needs room for one more",
                                "input")
        if request.max_output_tokens is not None and request.max_output_tokens > max_model_len:
            raise ProtocolError("integer_above_max_value", f"'max_output_tokens' must be <= {max_model_len} "
                                f"(the context length), got {request.max_output_tokens}", "max_output_tokens")
        if not request.generate:
            return 1  # the prompt is prefilled with one sampled token, which nobody sees
        wanted = request.max_output_tokens or self.state.config.default_max_output_tokens
        max_tokens = max(1, min(wanted, max_model_len - num_prompt_tokens))
        if request.logprobs is not None:
            entries = (request.logprobs + 1) * request.num_samples * max_tokens
            bound = self.state.config.limits.max_logprob_entries
            if entries > bound:
                raise ProtocolError("invalid_value", f"log-probabilities for {request.num_samples} sample(s) of "
                                    f"up to {max_tokens} tokens with {request.logprobs} alternatives are "
                                    f"{entries} entries, more than {bound}: lower max_output_tokens, the "
                                    "number of alternatives or of samples", "max_output_tokens")
        return max_tokens

    def _on_output(self, run: _Run, output: RequestOutput) -> None:
        """On the event loop: absorb one engine output, observe latencies, end the run when done."""
        stream = run.stream
        if stream.is_done:  # cancelled, abandoned or shut down while this output was on its way
            return
        now = time.monotonic()
        metrics = self.state.metrics
        if stream.request.generate and any(completion.delta_token_ids for completion in output.outputs):
            if run.last_token_time is None:
                metrics.time_to_first_token.observe(now - run.arrival_time)
            else:
                metrics.inter_token_latency.observe(now - run.last_token_time)
            run.last_token_time = now
        stream.absorb(output)
        if stream.is_done:
            metrics.e2e_request_latency.observe(now - run.arrival_time)
            self._runs.pop(stream.response_id, None)
            if stream.status != "failed":
                self._store(run)
        run.on_update(stream)

    def _store(self, run: _Run) -> None:
        """Keep the conversation with its reply, so a follow-up can name this response."""
        stream = run.stream
        reply = [{"role": "assistant", "content": stream.texts[0]}] if stream.texts else []
        self.state.conversations.put(stream.response_id, run.conversation + reply,
                                     owner=None if stream.request.store else run.owner)
