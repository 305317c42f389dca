"""Server events of `/v1/responses`: one response's events in order, built from the engine's outputs.

`ResponseStream` gives each event its `sequence_number` (no I/O here; the session sends them). It reads
the request for what the response object echoes, and the SamplingParams the engine runs for what
was resolved (the samples, log-probabilities, and the sampling defaults applied).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from localserve.engine.outputs import RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.server.request_model import GenerationRequest
from localserve.server.validation import ProtocolError


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: `resp_...`, `msg_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


TokenText = Callable[[int], str]


class ResponseStream:
    """The server events of one response, in order, built from the engine's outputs.

    `absorb` takes each RequestOutput (on the event loop); `drain` returns the events not yet sent:
    the opening events the first time, one `response.output_text.delta` per output item with all text
    absorbed since the last drain (so at most one per engine step, fewer for a slow client), and the
    closing events once the request has finished, been cancelled or failed.
    """

    def __init__(self, request: GenerationRequest, params: SamplingParams, response_id: str, model: str,
                 num_prompt_tokens: int, token_text: TokenText) -> None:
        self.request, self.params, self.response_id, self.model = request, params, response_id, model
        self.num_prompt_tokens = num_prompt_tokens
        self.token_text = token_text
        self.created_at = int(time.time())
        num_items = params.n if request.generate else 0  # a warm-up answers with no output
        self.item_ids = [new_id("msg") for _ in range(num_items)]
        self.texts = [""] * num_items
        self.pending_texts = [""] * num_items
        self.pending_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(num_items)]
        self.all_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(num_items)]
        self.num_output_tokens = [0] * num_items
        self.finish_reasons: list[str | None] = [None] * num_items
        self.final_token_ids: list[list[int] | None] = [None] * num_items  # each item's tokens once it ends
        self.num_cached_tokens = 0
        # when the response began, its first output token came and it ended (time.monotonic)
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.status = "in_progress"  # -> completed | incomplete | cancelled | failed
        self.incomplete_reason = "max_output_tokens"  # or "server_shutdown"
        self.error_message: str | None = None
        self._next_sequence_number = 0
        self._started = False
        self._closed = False

    @property
    def is_done(self) -> bool:
        """The engine is finished with this response (the closing events may still be unsent)."""
        return self.status != "in_progress"

    @property
    def ended_normally(self) -> bool:
        """The engine finished every item (a stop or the token limit): not failed, cancelled or shut down."""
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
    def has_unsent_events(self) -> bool:
        return not self._started or any(self.pending_texts) or any(self.pending_logprobs) or (
            self.is_done and not self._closed)

    def absorb(self, output: RequestOutput) -> None:
        """Take one engine output: new text (and logprobs), and the outcome once finished."""
        if self.is_done:  # cancelled while this output was on its way
            return
        self.num_cached_tokens = output.num_cached_tokens
        for completion in output.outputs[:len(self.texts)]:
            index = completion.index
            self.pending_texts[index] += completion.delta_text
            self.texts[index] += completion.delta_text
            self.num_output_tokens[index] = len(completion.token_ids)
            self.finish_reasons[index] = completion.finish_reason
            if completion.finish_reason is not None:
                self.final_token_ids[index] = list(completion.token_ids)
            if completion.delta_token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            if self.params.logprobs is not None and completion.delta_token_ids:
                first = len(completion.token_ids) - len(completion.delta_token_ids)
                for offset, token_id in enumerate(completion.delta_token_ids):
                    entry = self._logprob_entry(token_id, completion.logprobs[first + offset],
                                                completion.top_logprobs[first + offset]
                                                if len(completion.top_logprobs) > first + offset else [])
                    self.pending_logprobs[index].append(entry)
                    self.all_logprobs[index].append(entry)
        if output.error:
            self.fail(output.error)
        elif output.finished:
            self.status = "incomplete" if "length" in self.finish_reasons else "completed"
            self.finished_at = time.monotonic()

    def cancel(self) -> None:
        """The client cancelled: close with what was generated so far."""
        if not self.is_done:
            self.status, self.finished_at = "cancelled", time.monotonic()

    def shut_down(self) -> None:
        """The server is stopping: close as incomplete (reason `server_shutdown`) with the text so far."""
        if not self.is_done:
            self.status, self.incomplete_reason = "incomplete", "server_shutdown"
            self.finished_at = time.monotonic()

    def fail(self, message: str) -> None:
        """The engine failed this request; it closes with `response.failed`."""
        if not self.is_done:
            self.status, self.error_message = "failed", message
            self.finished_at = time.monotonic()

    def drain(self) -> list[dict[str, Any]]:
        """The events not sent yet, numbered."""
        events: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            events += [{"type": "response.created", "response": self.response_object("in_progress")},
                       {"type": "response.in_progress", "response": self.response_object("in_progress")}]
            for index, item_id in enumerate(self.item_ids):
                events.append({"type": "response.output_item.added", "output_index": index,
                               "item": self._message_item(index, "in_progress", with_text=False)})
                events.append({"type": "response.content_part.added", "item_id": item_id,
                               "output_index": index, "content_index": 0, "part": self._text_part("", [])})
        for index, item_id in enumerate(self.item_ids):
            if self.pending_texts[index] or self.pending_logprobs[index]:
                events.append({"type": "response.output_text.delta", "item_id": item_id,
                               "output_index": index, "content_index": 0, "delta": self.pending_texts[index],
                               "logprobs": self.pending_logprobs[index]})
                self.pending_texts[index], self.pending_logprobs[index] = "", []
        if self.is_done and not self._closed:
            self._closed = True
            events += self._closing_events()
        for event in events:
            event["sequence_number"] = self._next_sequence_number
            self._next_sequence_number += 1
            if self.request.stream_id is not None:
                event["stream_id"] = self.request.stream_id
        return events

    def _closing_events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item_status = "completed" if self.status == "completed" else "incomplete"
        for index, item_id in enumerate(self.item_ids):
            part = self._text_part(self.texts[index], self.all_logprobs[index])
            events += [{"type": "response.output_text.done", "item_id": item_id, "output_index": index,
                        "content_index": 0, "text": self.texts[index], "logprobs": self.all_logprobs[index]},
                       {"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                        "content_index": 0, "part": part},
                       {"type": "response.output_item.done", "output_index": index,
                        "item": self._message_item(index, item_status)}]
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(self.status,
                                                                                    "response.incomplete")
        events.append({"type": kind, "response": self.response_object(self.status)})
        return events

    def response_object(self, status: str) -> dict[str, Any]:
        """The `response` object of OpenAI's API for this response in `status`."""
        request, params = self.request, self.params
        done = status != "in_progress"
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.model, "instructions": request.instructions,
            "output": [self._message_item(i, "completed" if status == "completed" else "incomplete")
                       for i in range(len(self.item_ids))] if done else [],
            "error": {"code": "server_error", "message": self.error_message} if status == "failed" else None,
            "incomplete_details": {"reason": self.incomplete_reason} if status == "incomplete" else None,
            "max_output_tokens": request.max_output_tokens, "metadata": request.metadata,
            "previous_response_id": request.previous_response_id, "temperature": params.temperature,
            "top_p": params.top_p, "store": request.store, "usage": self.usage() if done else None,
            **request.echoed,
        }

    def usage(self) -> dict[str, Any]:
        """Token counts, with the prompt tokens served from the prefix cache."""
        output_tokens = sum(self.num_output_tokens)
        return {"input_tokens": self.num_prompt_tokens, "output_tokens": output_tokens,
                "total_tokens": self.num_prompt_tokens + output_tokens,
                "input_tokens_details": {"cached_tokens": self.num_cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def _message_item(self, index: int, status: str, with_text: bool = True) -> dict[str, Any]:
        content = [self._text_part(self.texts[index], self.all_logprobs[index])] if with_text else []
        return {"id": self.item_ids[index], "type": "message", "role": "assistant", "status": status,
                "content": content}

    def _text_part(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _logprob_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        entry = self._token_logprob(token_id, logprob)
        entry["top_logprobs"] = [self._token_logprob(top_id, top_logprob) for top_id, top_logprob in top]
        return entry

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "bytes": list(text.encode()), "logprob": logprob}
