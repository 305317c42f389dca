"""Running one response, whatever the API and transport: from a checked `GenerationRequest` to a
`GenerationStream`.

`GenerationService.start` finds the model the request names, resolves `previous_response_id` (scoped to
the asking connection for `store: false` responses), takes a lease on the model (waiting while it is
loaded: server/registry/registry.py), renders and tokenizes the conversation off the event loop with that model's
tokenizer, checks the bounds that need the prompt's length (the context, the size of the
log-probabilities), turns the request into SamplingParams (the model's defaults applied there, once),
submits to the model's engine thread, and absorbs the engine's outputs into the stream on the event
loop, calling the transport's `on_update` after each. When the response ends, its lease goes back and
its conversation is stored for the next turn. The websocket session is one transport, the HTTP API
another.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from localserve.engine.constraints import GrammarError
from localserve.engine.multimodal import MultiModalInputs
from localserve.engine.outputs import RequestOutput
from localserve.loading.model_folder import ModelEntry
from localserve.server.config import ServerConfig
from localserve.server.generation.chat_turns import TurnPlan, plan_turn, resolve_tool_results
from localserve.server.generation.conversations import ConversationStore
from localserve.server.generation.image_prompt import RequestImages, conversation_images, keep_images, prepare_images
from localserve.server.generation.stream import GenerationStream, new_id
from localserve.server.monitor.metrics import ServerMetrics
from localserve.server.registry.engine_access import on_event_loop
from localserve.server.registry.registry import ModelLease, ModelRegistry
from localserve.server.registry.served_model import ChatTokenizer, ServedModel
from localserve.server.request.generation_request import (
    STORED_IMAGES,
    GenerationRequest,
    Message,
    message_chars,
    template_view,
)
from localserve.server.request.images import with_image_parts
from localserve.server.request.messages import REASONING_KEY
from localserve.server.request.validation import ProtocolError
from localserve.tokenizer.tools import ChatFormatError

OnUpdate = Callable[[GenerationStream], None]


@dataclass
class _Run:
    """A response between submission and its end: what storing and metrics need."""

    stream: GenerationStream
    lease: ModelLease  # the model serving it, until it ends
    conversation: list[Message]  # the messages to store with the reply
    owner: str | None  # the connection that asked (None: an HTTP request)
    on_update: OnUpdate
    arrival_time: float
    last_token_time: float | None = None


def holds_images(conversation: list[Message]) -> bool:
    """Whether a message of the conversation holds images (generation/image_prompt.py's, only then)."""
    return any(STORED_IMAGES in message for message in conversation)


class GenerationService:
    """Starts, cancels and ends responses for every transport of one server."""

    def __init__(self, models: ModelRegistry, config: ServerConfig, conversations: ConversationStore,
                 metrics: ServerMetrics) -> None:
        self.models, self.config = models, config
        self.conversations, self.metrics = conversations, metrics
        self._runs: dict[str, _Run] = {}  # by response id, until the response ends
        self._num_waiting = 0  # requests waiting for their model

    @property
    def num_running(self) -> int:
        """Responses started and not ended, those waiting for their model included."""
        return len(self._runs) + self._num_waiting

    async def start(self, request: GenerationRequest, owner: str | None, on_update: OnUpdate,
                    entry: ModelEntry | None = None) -> GenerationStream:
        """Submit `request` for connection `owner` (None: an HTTP request, which nothing outlives but what it
        stores) on the model `entry` (None: the one the request names, looked up here); raises ProtocolError if
        it cannot run."""
        config = self.config
        entry = entry if entry is not None else self.models.find(request.model)
        if self.num_running >= config.max_running_responses:
            raise ProtocolError("server_busy", f"the server is running its limit of "
                                f"{config.max_running_responses} responses; retry later",
                                error_type="rate_limit_error", status=429)
        conversation = self._conversation(request, owner)
        lease = await self._acquire(entry)
        try:
            lease.model.check_generates()
            run = await self._submit(request, lease, conversation, owner, on_update)
        except BaseException:
            lease.release()
            raise
        self._runs[run.stream.response_id] = run
        return run.stream

    async def _acquire(self, entry: ModelEntry) -> ModelLease:
        self._num_waiting += 1
        try:
            return await self.models.acquire(entry)
        finally:
            self._num_waiting -= 1

    async def _submit(self, request: GenerationRequest, lease: ModelLease, conversation: list[Message],
                      owner: str | None, on_update: OnUpdate) -> _Run:
        model, tokenizer = lease.model, lease.tokenizer
        prompt_ids, plan, images, multimodal = await self._prompt(request, conversation, lease)
        params = request.sampling_params(model.sampling_defaults, self._max_tokens(request, model, len(prompt_ids)),
                                         **(self._engine_fields(request, plan) if request.generate else {}))
        stream = GenerationStream(request, params, new_id("resp"), model.served_name, len(prompt_ids),
                                lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
                                plan.parser if plan is not None and plan.parses else None)
        run = _Run(stream, lease, conversation, owner, on_update, time.monotonic())
        loop = asyncio.get_running_loop()
        try:
            lease.engine.submit(prompt_ids, params,
                                on_event_loop(loop, lambda output: self._on_output(run, output)),
                                request_id=stream.response_id,
                                **({"multimodal": multimodal} if multimodal is not None else {}))
        except GrammarError as exc:  # only a turn's grammar reaches the engine
            field = plan.grammar_field if plan is not None else request.wire_name("output_format")
            raise ProtocolError("invalid_value", f"'{field}': {exc}", field) from None
        except ValueError as exc:  # a bound of the engine's (an image span longer than a step: its part named)
            refusal = images.refusal(exc) if images is not None else None
            raise refusal or ProtocolError("invalid_request", str(exc)) from None
        return run

    async def count_prompt_tokens(self, request: GenerationRequest, owner: str | None) -> int:
        """The tokens `request`'s prompt would take, rendered as `start` renders it, without running it."""
        entry = self.models.find(request.model)
        conversation = self._conversation(request, owner)
        lease = await self._acquire(entry)
        try:
            prompt_ids, *_ = await self._prompt(request, conversation, lease)
        finally:
            lease.release()
        return len(prompt_ids)

    async def render_prompt(self, request: GenerationRequest, owner: str | None) -> str:
        """The text of `request`'s chat prompt as `start` renders it (tools and tool turns as the served model's
        chat format writes them), without running it. An image stands as the chat template writes it (its
        family's marker, as transformers' apply_chat_template renders it), not as the image's tokens the
        prompt holds in its place (Gemma 3's hundreds of soft tokens)."""
        entry = self.models.find(request.model)
        conversation = self._conversation(request, owner)
        lease = await self._acquire(entry)
        try:
            self._check_images(request, conversation, lease)
            messages, template_inputs, _ = self._chat_inputs(request, conversation, lease)
            field = request.wire_name("input")
            try:
                return await asyncio.to_thread(lease.tokenizer.apply_chat_template, messages, True,
                                               **template_inputs)
            except Exception as exc:  # no chat template, a template that raised
                raise ProtocolError("invalid_prompt", f"the chat template could not render the input: "
                                    f"{type(exc).__name__}: {str(exc)[:300]}", field) from None
        finally:
            lease.release()

    def _conversation(self, request: GenerationRequest, owner: str | None) -> list[Message]:
        """The stored turns `previous_response_id` names, then the request's input; its size checked."""
        history: list[Message] = []
        if request.previous_response_id is not None:
            found = self.conversations.get(request.previous_response_id, owner)
            if found is None:
                raise ProtocolError("previous_response_not_found", f"previous response "
                                    f"{request.previous_response_id!r} is not available here (unknown, "
                                    "evicted, or a store: false response of another connection); send the "
                                    "whole conversation instead", "previous_response_id")
            history = found
        held = request.input_messages
        if request.images and request.prompt is None:  # kept on their messages (stored with the conversation)
            held = keep_images(held, request.images)
        conversation = history + held
        limit = self.config.limits.max_conversation_chars
        num_chars = sum(message_chars(message) for message in conversation) + len(request.instructions or "")
        if num_chars > limit:
            raise ProtocolError("string_above_max_length", f"the conversation holds {num_chars} characters; at "
                                f"most {limit} are accepted: start a new one", request.wire_name("input"))
        return conversation

    async def _prompt(self, request: GenerationRequest, conversation: list[Message], lease: ModelLease
                      ) -> tuple[list[int], TurnPlan | None, RequestImages | None, MultiModalInputs | None]:
        """The prompt's token ids with the lease's tokenizer, the chat turn's plan (None for a prompt
        tokenized as it is), and its images and what the engine is given of them (None, None: none)."""
        images = self._check_images(request, conversation, lease)
        if request.prompt is not None:
            ids = await self._encode_text(lease.tokenizer, request.prompt, request.wire_name("input"))
            return ids, None, None, None
        messages, template_inputs, plan = self._chat_inputs(request, conversation, lease)
        image_prompt = await prepare_images(lease.vision, images, lease.prepared_images) if images else None
        # A warm-up renders no assistant header, so a later turn's prompt begins with exactly its tokens.
        prompt_ids = await self._encode_chat(lease.tokenizer, messages, request.generate, request.wire_name("input"),
                                             template_inputs, image_prompt)
        if image_prompt is None:
            return prompt_ids, plan, None, None
        return prompt_ids, plan, image_prompt, image_prompt.multimodal(prompt_ids)

    @staticmethod
    def _check_images(request: GenerationRequest, conversation: list[Message], lease: ModelLease) -> list:
        """The conversation's images (the request's and those a stored conversation keeps), in prompt order;
        a 400 for images to a model that takes none, and for images with a prompt tokenized as it is."""
        lease.model.check_images(request)
        if request.prompt is not None and request.images:
            where = request.images[0].image.where
            raise ProtocolError("invalid_prompt", f"'{where}': a raw prompt (tokenized as it is, without the chat "
                                "template) cannot place images; send them with the chat template applied "
                                "(Ollama: raw false)", where)
        images = conversation_images(conversation) if request.prompt is None and holds_images(conversation) else []
        if images and lease.vision is None:  # a stored conversation's images, continued on a text model
            where = images[0].image.where
            raise ProtocolError("model_takes_no_images", f"the conversation holds an image ('{where}' of an "
                                f"earlier turn); model {lease.model.served_name!r} does not take images", "model")
        return images

    @staticmethod
    def _chat_inputs(request: GenerationRequest, conversation: list[Message],
                     lease: ModelLease) -> tuple[list[Message], dict[str, Any], TurnPlan]:
        """What the chat template renders: the instructions and the conversation (its tool results resolved, its
        tool turns converted as the model's chat format reads them), the turn's tools and template variables;
        and the turn's plan."""
        field = request.wire_name("input")
        resolve_tool_results(conversation, field)
        plan = plan_turn(request, lease.model.chat_format)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        messages = system + [template_view(message) for message in conversation]
        if holds_images(conversation):
            messages = with_image_parts(messages, conversation_images(conversation), first=len(system))
        if plan.turn is None:
            return messages, {}, plan
        try:
            inputs = plan.turn.chat_inputs(messages)
        except ChatFormatError as error:
            raise ProtocolError("invalid_value", f"'{field}': {error}", field) from None
        return inputs.messages, {"tools": inputs.tools, **inputs.variables}, plan

    @staticmethod
    def _engine_fields(request: GenerationRequest, plan: TurnPlan | None) -> dict[str, Any]:
        """SamplingParams' fields of the turn; a prompt tokenized as it is (Ollama's raw) still gets the
        answer's format as its grammar."""
        if plan is not None:
            return plan.engine_fields()
        return {"grammar": request.output_format.grammar()} if request.output_format is not None else {}

    def cancel(self, stream: GenerationStream) -> None:
        """The client cancelled: its blocks go back at once; the response ends with its text so far."""
        self._stop(stream, GenerationStream.cancel, store=True)

    def abandon(self, stream: GenerationStream) -> None:
        """The client went away: stop the response, store nothing."""
        self._stop(stream, GenerationStream.cancel, store=False)

    def shut_down(self, stream: GenerationStream) -> None:
        """The server is stopping: the response ends incomplete (reason `server_shutdown`)."""
        self._stop(stream, GenerationStream.shut_down, store=False)

    def end_owner(self, owner: str) -> None:
        """The connection (or HTTP request) `owner` is over: forget its store: false conversations."""
        self.conversations.drop_owner(owner)

    def _stop(self, stream: GenerationStream, end: Callable[[GenerationStream], None], store: bool) -> None:
        run = self._runs.pop(stream.response_id, None)
        if run is None:
            return
        run.lease.engine.abort(stream.response_id)
        run.lease.release()
        end(stream)
        if store:
            self._store(run)
        run.on_update(stream)

    @staticmethod
    async def _encode_chat(tokenizer: ChatTokenizer, messages: list[Message], add_generation_prompt: bool,
                           field: str, template_inputs: dict[str, Any], images: RequestImages | None) -> list[int]:
        """The prompt's ids: the messages rendered with the turn's tools and template variables, each image's
        marker expanded into its tokens."""
        expand = {"expand": images.expand} if images is not None else {}
        try:  # rendering and tokenizing a long prompt must not hold up the other connections
            prompt_ids = await asyncio.to_thread(tokenizer.encode_chat, messages, add_generation_prompt,
                                                 **template_inputs, **expand)
        except ProtocolError as error:  # the images' expansion: the template placed another number of images
            if images is None or error.param not in {image.where for image in images.images}:
                raise
            marker = images.prompt.encoder.marker

            def markers(kept: list[Message]) -> int:  # the markers the template writes for `kept`
                found: list[int] = []

                def count(text: str) -> str:
                    found.append(text.count(marker))
                    return text
                tokenizer.encode_chat(kept, add_generation_prompt, **template_inputs, expand=count)
                return found[-1]
            raise await asyncio.to_thread(images.name_unplaced, error, messages, markers) from None
        except Exception as exc:  # no chat template, a template that raised, a tokenizer that refused
            raise ProtocolError("invalid_prompt", f"the chat template could not render the input: "
                                f"{type(exc).__name__}: {str(exc)[:300]}", field) from None
        if not prompt_ids:
            raise ProtocolError("invalid_prompt", "the input renders to an empty prompt", field)
        return prompt_ids

    @staticmethod
    async def _encode_text(tokenizer: ChatTokenizer, text: str, field: str) -> list[int]:
        prompt_ids = await asyncio.to_thread(tokenizer.encode, text)
        if not prompt_ids:
            raise ProtocolError("invalid_prompt", "the prompt is empty", field)
        return prompt_ids

    def _max_tokens(self, request: GenerationRequest, model: ServedModel, num_prompt_tokens: int) -> int:
        """max_output_tokens, cut to what the model's context has room for after the prompt; bounds checked."""
        max_model_len, field = model.max_model_len, request.wire_name("max_tokens")
        window = "the context"
        if request.context_tokens is not None and request.context_tokens < max_model_len:
            max_model_len, window = request.context_tokens, f"'{request.wire_name('context_tokens')}'"
        if num_prompt_tokens >= max_model_len:
            raise ProtocolError("context_length_exceeded", f"the prompt is {num_prompt_tokens} tokens; "
                                f"{window} holds {max_model_len}, and generating needs room for one more",
                                request.wire_name("input"))
        if request.max_output_tokens is not None and request.max_output_tokens > max_model_len:
            raise ProtocolError("integer_above_max_value", f"'{field}' must be <= {max_model_len} ({window}'s "
                                f"length), got {request.max_output_tokens}", field)
        if not request.generate:
            return 1  # the prompt is prefilled with one sampled token, which nobody sees
        room = max_model_len - num_prompt_tokens
        wanted = request.max_output_tokens or self.config.default_max_output_tokens or room
        max_tokens = max(1, min(wanted, room))
        sampling = request.sampling
        if sampling.logprobs is not None:
            entries = (sampling.logprobs + 1) * sampling.num_samples * max_tokens
            bound = self.config.limits.max_logprob_entries
            if entries > bound:
                raise ProtocolError("invalid_value", f"log-probabilities for {sampling.num_samples} sample(s) of "
                                    f"up to {max_tokens} tokens with {sampling.logprobs} alternatives are "
                                    f"{entries} entries, more than {bound}: lower {field}, the number of "
                                    "alternatives or of samples", field)
        return max_tokens

    def _on_output(self, run: _Run, output: RequestOutput) -> None:
        """On the event loop: absorb one engine output, observe latencies, end the run when done."""
        stream = run.stream
        if stream.is_done:  # cancelled, abandoned or shut down while this output was on its way
            return
        now = time.monotonic()
        metrics = self.metrics
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
            run.lease.release()
            if stream.status != "failed" and (stream.request.store or run.owner is not None):
                self._store(run)  # a store: false answer over HTTP has nobody to continue it
        run.on_update(stream)

    def _store(self, run: _Run) -> None:
        """Keep the conversation with its reply, so a follow-up can name this response."""
        stream = run.stream
        reply: list[Message] = []
        if stream.samples:
            sample = stream.samples[0]
            reply = [{"role": "assistant", "content": sample.content}]
            if sample.reasoning:  # rendered again where the template keeps it (a tool loop)
                reply[0][REASONING_KEY] = sample.reasoning
            if sample.calls:
                reply[0]["tool_calls"] = [call.message_call() for call in sample.calls]
        self.conversations.put(stream.response_id, run.conversation + reply,
                                     owner=None if stream.request.store else run.owner)
