"""Server events of `/v1/responses`: one response's events in order, built from the engine's outputs.

`ResponseStream` gives each event its `sequence_number` (no I/O here; the session sends them). It reads
the request for what the response object echoes, and the SamplingParams the engine runs for what
was resolved (the samples, log-probabilities, and the sampling defaults applied).

Each sample's text goes through its `SampleOutput` (server/generation/sample_output.py), which the chat format's parser
splits into reasoning, answer text and tool calls. A plain sample (no parser) has one message item, added
when the response opens; a parsed one gets its output items as they come, in order: a `reasoning` item
(`response.reasoning_text.delta`), a `message` (`response.output_text.delta`), one `function_call` item per
call (`response.function_call_arguments.delta` / `.done`); an item is done when the next one of its sample
opens, or when the response ends.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from localserve.engine.outputs import RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.server.generation.sample_output import SampleOutput
from localserve.server.request.generation_request import GenerationRequest
from localserve.server.request.validation import ProtocolError
from localserve.tokenizer.chat_format import ChatStreamParser
from localserve.tokenizer.stream_events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: `resp_...`, `msg_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


Decode = Callable[[Sequence[int]], str]
TokenText = Callable[[int], str]
ParserFactory = Callable[[], ChatStreamParser]


class OutputItem:
    """One item of a response's `output`: a sample's message, reasoning or one of its calls."""

    def __init__(self, kind: str, sample: int, call: int | None = None) -> None:
        self.kind, self.sample, self.call = kind, sample, call
        self.id = new_id({"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind])
        self.done = False


class ResponseStream:
    """The server events of one response, in order, built from the engine's outputs.

    `absorb` takes each RequestOutput (on the event loop); `drain` returns the events not yet sent:
    the opening events the first time, the deltas of each sample absorbed since the last drain (one
    `response.output_text.delta` per message with all its text, so at most one per engine step, fewer
    for a slow client), and the closing events once the request has finished, been cancelled or failed.
    `parser` makes each sample's stream parser (None: plain text).
    """

    def __init__(self, request: GenerationRequest, params: SamplingParams, response_id: str, model: str,
                 num_prompt_tokens: int, token_text: TokenText, parser: ParserFactory | None = None,
                 decode: Decode | None = None) -> None:
        self.request, self.params, self.response_id, self.model = request, params, response_id, model
        self.num_prompt_tokens = num_prompt_tokens
        self.token_text = token_text
        self.decode = decode  # token ids -> text with the model's tokenizer (special tokens kept), where asked
        self.created_at = int(time.time())
        num_samples = params.n if request.generate else 0  # a warm-up answers with no output
        self.samples = [SampleOutput(parser() if parser is not None else None) for _ in range(num_samples)]
        self.parsed = parser is not None
        # Plain samples have their message from the start; parsed ones open items as their events come.
        self.items = [] if self.parsed else [OutputItem("message", index) for index in range(num_samples)]
        self.final_token_ids: list[list[int] | None] = [None] * num_samples  # each sample's tokens once it ends
        self.output_chars = [0] * num_samples  # the characters of text the engine gave each sample, all parts
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
    def texts(self) -> list[str]:
        """Each sample's answer text (its content, without reasoning or calls)."""
        return [sample.content for sample in self.samples]

    @property
    def is_done(self) -> bool:
        """The engine is finished with this response (the closing events may still be unsent)."""
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
    def has_unsent_events(self) -> bool:
        return not self._started or any(sample.has_pending for sample in self.samples) or (
            self.is_done and not self._closed)

    def absorb(self, output: RequestOutput) -> None:
        """Take one engine output: new text (and logprobs), and the outcome once finished."""
        if self.is_done:  # cancelled while this output was on its way
            return
        self.num_cached_tokens = output.num_cached_tokens
        for completion in output.outputs[:len(self.samples)]:
            sample = self.samples[completion.index]
            sample.feed(completion.delta_text)
            self.output_chars[completion.index] += len(completion.delta_text)
            sample.num_output_tokens = len(completion.token_ids)
            sample.num_reasoning_tokens = completion.num_reasoning_tokens
            sample.finish_reason = completion.finish_reason
            if completion.finish_reason is not None:
                self.final_token_ids[completion.index] = list(completion.token_ids)
            if completion.delta_token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            if self.params.logprobs is not None and completion.delta_token_ids:
                first = len(completion.token_ids) - len(completion.delta_token_ids)
                for offset, token_id in enumerate(completion.delta_token_ids):
                    entry = self._logprob_entry(token_id, completion.logprobs[first + offset],
                                                completion.top_logprobs[first + offset]
                                                if len(completion.top_logprobs) > first + offset else [])
                    sample.pending_logprobs.append(entry)
                    sample.all_logprobs.append(entry)
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
        """The engine failed this request; it closes with `response.failed`."""
        if not self.is_done:
            self.error_message = message
            self._end("failed")

    def _end(self, status: str) -> None:
        for sample in self.samples:
            sample.finish()
        self.status, self.finished_at = status, time.monotonic()

    def drain(self) -> list[dict[str, Any]]:
        """The events not sent yet, numbered."""
        events: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            events += [{"type": "response.created", "response": self.response_object("in_progress")},
                       {"type": "response.in_progress", "response": self.response_object("in_progress")}]
            for item in list(self.items):
                events += self._item_added(item)
        for index, sample in enumerate(self.samples):
            pending, entries = sample.take_pending()
            if not self.parsed:
                text = "".join(event.text for event in pending)
                if text or entries:
                    events.append(self._text_delta(self.items[index], text, entries))
                continue
            events += self._parsed_events(index, pending, entries)
        if self.is_done and not self._closed:
            self._closed = True
            events += self._closing_events()
        for event in events:
            event["sequence_number"] = self._next_sequence_number
            self._next_sequence_number += 1
            if self.request.stream_id is not None:
                event["stream_id"] = self.request.stream_id
        return events

    # ------------------------------------------------------------------ items of parsed samples
    def _parsed_events(self, index: int, pending: list, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        text = ""  # a message's text is sent in one delta per drain
        for event in pending:
            if isinstance(event, ContentDelta):
                events += self._open(index, "message")
                text += event.text
                continue
            if text:
                events.append(self._text_delta(self._last(index), text, entries))
                text, entries = "", []
            if isinstance(event, ReasoningDelta):
                events += self._open(index, "reasoning")
                events.append({"type": "response.reasoning_text.delta", "item_id": self._last(index).id,
                               "output_index": self._output_index(self._last(index)), "content_index": 0,
                               "delta": event.text})
            elif isinstance(event, ToolCallStart):
                events += self._open(index, "function_call", event.index)
            elif isinstance(event, ToolCallArgumentsDelta):
                item = self._call_item(index, event.index)
                events.append({"type": "response.function_call_arguments.delta", "item_id": item.id,
                               "output_index": self._output_index(item), "delta": event.text})
            elif isinstance(event, ToolCallEnd):
                events += self._item_done(self._call_item(index, event.index))
        if text or (entries and self._last(index) is not None and self._last(index).kind == "message"):
            events += self._open(index, "message")
            events.append(self._text_delta(self._last(index), text, entries))
        return events

    def _settle_items(self) -> None:
        """The items of a response answered whole (never drained): each sample's, in its order, all done."""
        for index, sample in enumerate(self.samples):
            sample.take_pending()
            kinds = [("reasoning", None)] if sample.reasoning else []
            kinds += [("message", None)] if sample.content or not sample.calls else []
            kinds += [("function_call", number) for number in range(len(sample.calls))]
            for kind, call in kinds:
                item = OutputItem(kind, index, call)
                item.done = True
                self.items.append(item)

    def _last(self, sample: int) -> OutputItem | None:
        return next((item for item in reversed(self.items) if item.sample == sample), None)

    def _call_item(self, sample: int, call: int) -> OutputItem:
        return next(item for item in self.items if item.sample == sample and item.call == call)

    def _output_index(self, item: OutputItem) -> int:
        return self.items.index(item)

    def _open(self, sample: int, kind: str, call: int | None = None) -> list[dict[str, Any]]:
        """Events that open a `kind` item for the sample (none if its last item is one, still open), closing
        the sample's open item before it."""
        last = self._last(sample)
        if last is not None and last.kind == kind and not last.done and kind != "function_call":
            return []
        events = self._item_done(last) if last is not None and not last.done else []
        item = OutputItem(kind, sample, call)
        self.items.append(item)
        return events + self._item_added(item)

    # ------------------------------------------------------------------ events of one item
    def _item_added(self, item: OutputItem) -> list[dict[str, Any]]:
        index = self._output_index(item)
        events = [{"type": "response.output_item.added", "output_index": index,
                   "item": self._item(item, "in_progress", opening=True)}]
        if item.kind != "function_call":
            part = self._text_part("", []) if item.kind == "message" else self._reasoning_part("")
            events.append({"type": "response.content_part.added", "item_id": item.id, "output_index": index,
                           "content_index": 0, "part": part})
        return events

    def _item_done(self, item: OutputItem, status: str = "completed") -> list[dict[str, Any]]:
        item.done = True
        index, sample = self._output_index(item), self.samples[item.sample]
        events: list[dict[str, Any]] = []
        if item.kind == "message":
            text = sample.content
            events += [{"type": "response.output_text.done", "item_id": item.id, "output_index": index,
                        "content_index": 0, "text": text, "logprobs": sample.all_logprobs},
                       {"type": "response.content_part.done", "item_id": item.id, "output_index": index,
                        "content_index": 0, "part": self._text_part(text, sample.all_logprobs)}]
        elif item.kind == "reasoning":
            events += [{"type": "response.reasoning_text.done", "item_id": item.id, "output_index": index,
                        "content_index": 0, "text": sample.reasoning},
                       {"type": "response.content_part.done", "item_id": item.id, "output_index": index,
                        "content_index": 0, "part": self._reasoning_part(sample.reasoning)}]
        else:
            call = sample.calls[item.call]
            events.append({"type": "response.function_call_arguments.done", "item_id": item.id,
                           "output_index": index, "name": call.name, "arguments": call.arguments})
        events.append({"type": "response.output_item.done", "output_index": index, "item": self._item(item, status)})
        return events

    def _text_delta(self, item: OutputItem, text: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "response.output_text.delta", "item_id": item.id, "output_index": self._output_index(item),
                "content_index": 0, "delta": text, "logprobs": entries}

    def _closing_events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item_status = "completed" if self.status == "completed" else "incomplete"
        if self.parsed:  # a sample that said nothing still answers with an (empty) message
            for index in range(len(self.samples)):
                if self._last(index) is None:
                    events += self._open(index, "message")
        for item in self.items:
            if not item.done:
                events += self._item_done(item, item_status)
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(self.status,
                                                                                    "response.incomplete")
        events.append({"type": kind, "response": self.response_object(self.status)})
        return events

    def response_object(self, status: str) -> dict[str, Any]:
        """The `response` object of OpenAI's API for this response in `status`."""
        request, params = self.request, self.params
        done = status != "in_progress"
        item_status = "completed" if status == "completed" else "incomplete"
        if done and self.parsed and not self._started:
            self._settle_items()
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.model, "instructions": request.instructions,
            "output": [self._item(item, item_status) for item in self.items] if done else [],
            "error": {"code": "server_error", "message": self.error_message} if status == "failed" else None,
            "incomplete_details": {"reason": self.incomplete_reason} if status == "incomplete" else None,
            "max_output_tokens": request.max_output_tokens, "metadata": request.metadata,
            "previous_response_id": request.previous_response_id, "temperature": params.temperature,
            "top_p": params.top_p, "store": request.store, "usage": self.usage() if done else None,
            **request.echoed,
        }

    def usage(self) -> dict[str, Any]:
        """Token counts, with the prompt tokens served from the prefix cache and the reasoning's tokens."""
        output_tokens = sum(sample.num_output_tokens for sample in self.samples)
        return {"input_tokens": self.num_prompt_tokens, "output_tokens": output_tokens,
                "total_tokens": self.num_prompt_tokens + output_tokens,
                "input_tokens_details": {"cached_tokens": self.num_cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens}}

    @property
    def num_reasoning_tokens(self) -> int:
        """Output tokens inside reasoning blocks, every sample."""
        return sum(sample.num_reasoning_tokens for sample in self.samples if self.parsed)

    def _item(self, item: OutputItem, status: str, opening: bool = False) -> dict[str, Any]:
        sample = self.samples[item.sample]
        if item.kind == "function_call":
            call = sample.calls[item.call]
            namespace = self.request.tool_namespaces.get(call.name)  # a function of a namespace tool names it
            return {"id": item.id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
                    **({"namespace": namespace} if namespace is not None else {}),
                    "arguments": "" if opening else call.arguments}
        if item.kind == "reasoning":
            content = [] if opening else [self._reasoning_part(sample.reasoning)]
            return {"id": item.id, "type": "reasoning", "status": status, "summary": [], "content": content}
        content = [] if opening else [self._text_part(sample.content, sample.all_logprobs)]
        return {"id": item.id, "type": "message", "role": "assistant", "status": status, "content": content}

    def _text_part(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _reasoning_part(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text}

    def _logprob_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        entry = self._token_logprob(token_id, logprob)
        entry["top_logprobs"] = [self._token_logprob(top_id, top_logprob) for top_id, top_logprob in top]
        return entry

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "bytes": list(text.encode()), "logprob": logprob}
