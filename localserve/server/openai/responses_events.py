"""The Responses API's answer, read from a `GenerationStream`: its server events in order, and the `response`
object (no I/O here; the websocket session and the HTTP runner send them).

`ResponsesEvents` gives each event its `sequence_number`. It reads the request for what the response object
echoes, and the SamplingParams the engine runs for what was resolved (the samples, log-probabilities, and
the sampling defaults applied).

A plain sample (no parser) has one message item, added when the response opens; a parsed one gets its
output items as they come, in order: a `reasoning` item (`response.reasoning_text.delta`), a `message`
(`response.output_text.delta`), one `function_call` item per call (`response.function_call_arguments.delta`
/ `.done`); an item is done when the next one of its sample opens, or when the response ends.
"""

from __future__ import annotations

import time
from typing import Any

from localserve.server.generation.sample_output import TokenLogprob
from localserve.server.generation.stream import GenerationStream, new_id
from localserve.server.openai.logprobs import logprob_entries
from localserve.server.wire.http_exchange import EVENT_STREAM, sse
from localserve.tokenizer.stream_events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)


class OutputItem:
    """One item of a response's `output`: a sample's message, reasoning or one of its calls."""

    def __init__(self, kind: str, sample: int, call: int | None = None) -> None:
        self.kind, self.sample, self.call = kind, sample, call
        self.id = new_id({"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind])
        self.done = False


class ResponsesEvents:
    """The server events of one response, in order, read from its stream (an `HttpView` too).

    `drain` returns the events not yet sent: the opening events the first time, the deltas of each sample
    absorbed since the last drain (one `response.output_text.delta` per message with all its text, so at most
    one per engine step, fewer for a slow client), and the closing events once the stream is done.
    """

    stream_type = EVENT_STREAM

    def __init__(self, stream: GenerationStream) -> None:
        self.stream = stream
        # Plain samples have their message from the start; parsed ones open items as their events come.
        self.items = [] if stream.parsed else [OutputItem("message", index) for index in range(len(stream.samples))]
        self._next_sequence_number = 0
        self._started = False
        self._closed = False

    @property
    def has_unsent_events(self) -> bool:
        return not self._started or self.stream.has_pending or (self.stream.is_done and not self._closed)

    # ------------------------------------------------------------------ over HTTP
    def pieces(self, done: bool) -> bytes:
        return b"".join(sse(event, event["type"]) for event in self.drain())

    def whole(self) -> dict[str, Any]:
        return self.response_object(self.stream.status)  # it tells every outcome itself

    # ------------------------------------------------------------------ events
    def drain(self) -> list[dict[str, Any]]:
        """The events not sent yet, numbered."""
        stream = self.stream
        events: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            events += [{"type": "response.created", "response": self.response_object("in_progress")},
                       {"type": "response.in_progress", "response": self.response_object("in_progress")}]
            for item in list(self.items):
                events += self._item_added(item)
        for index, sample in enumerate(stream.samples):
            pending, entries = sample.take_pending()
            if not stream.parsed:
                text = "".join(event.text for event in pending)
                if text or entries:
                    events.append(self._text_delta(self.items[index], text, entries))
                continue
            events += self._parsed_events(index, pending, entries)
        if stream.is_done and not self._closed:
            self._closed = True
            events += self._closing_events()
        for event in events:
            event["sequence_number"] = self._next_sequence_number
            self._next_sequence_number += 1
            if stream.request.stream_id is not None:
                event["stream_id"] = stream.request.stream_id
        return events

    # ------------------------------------------------------------------ items of parsed samples
    def _parsed_events(self, index: int, pending: list, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
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
        for index, sample in enumerate(self.stream.samples):
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
        index, sample = self._output_index(item), self.stream.samples[item.sample]
        events: list[dict[str, Any]] = []
        if item.kind == "message":
            text, logprobs = sample.content, logprob_entries(sample.all_logprobs)
            events += [{"type": "response.output_text.done", "item_id": item.id, "output_index": index,
                        "content_index": 0, "text": text, "logprobs": logprobs},
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

    def _text_delta(self, item: OutputItem, text: str, entries: list[TokenLogprob]) -> dict[str, Any]:
        return {"type": "response.output_text.delta", "item_id": item.id, "output_index": self._output_index(item),
                "content_index": 0, "delta": text, "logprobs": logprob_entries(entries)}

    def _closing_events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        status = self.stream.status
        item_status = "completed" if status == "completed" else "incomplete"
        if self.stream.parsed:  # a sample that said nothing still answers with an (empty) message
            for index in range(len(self.stream.samples)):
                if self._last(index) is None:
                    events += self._open(index, "message")
        for item in self.items:
            if not item.done:
                events += self._item_done(item, item_status)
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(status, "response.incomplete")
        events.append({"type": kind, "response": self.response_object(status)})
        return events

    def response_object(self, status: str) -> dict[str, Any]:
        """The `response` object of OpenAI's API for this response in `status`."""
        stream = self.stream
        request, params = stream.request, stream.params
        done = status != "in_progress"
        item_status = "completed" if status == "completed" else "incomplete"
        if done and stream.parsed and not self._started:
            self._settle_items()
        return {
            "id": stream.response_id, "object": "response", "created_at": stream.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": stream.model, "instructions": request.instructions,
            "output": [self._item(item, item_status) for item in self.items] if done else [],
            "error": {"code": "server_error", "message": stream.error_message} if status == "failed" else None,
            "incomplete_details": {"reason": stream.incomplete_reason} if status == "incomplete" else None,
            "max_output_tokens": request.max_output_tokens, "metadata": request.metadata,
            "previous_response_id": request.previous_response_id, "temperature": params.temperature,
            "top_p": params.top_p, "store": request.store, "usage": self.usage() if done else None,
            **request.echoed,
        }

    def usage(self) -> dict[str, Any]:
        """Token counts, with the prompt tokens served from the prefix cache and the reasoning's tokens."""
        stream = self.stream
        output_tokens = stream.num_output_tokens
        return {"input_tokens": stream.num_prompt_tokens, "output_tokens": output_tokens,
                "total_tokens": stream.num_prompt_tokens + output_tokens,
                "input_tokens_details": {"cached_tokens": stream.num_cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": stream.num_reasoning_tokens}}

    def _item(self, item: OutputItem, status: str, opening: bool = False) -> dict[str, Any]:
        sample = self.stream.samples[item.sample]
        if item.kind == "function_call":
            call = sample.calls[item.call]
            namespace = self.stream.request.tool_namespaces.get(call.name)  # a namespace tool's function names it
            return {"id": item.id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
                    **({"namespace": namespace} if namespace is not None else {}),
                    "arguments": "" if opening else call.arguments}
        if item.kind == "reasoning":
            content = [] if opening else [self._reasoning_part(sample.reasoning)]
            return {"id": item.id, "type": "reasoning", "status": status, "summary": [], "content": content}
        content = [] if opening else [self._text_part(sample.content, sample.all_logprobs)]
        return {"id": item.id, "type": "message", "role": "assistant", "status": status, "content": content}

    def _text_part(self, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprob_entries(logprobs)}

    def _reasoning_part(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text}
