"""The engine: requests in, one scheduled step at a time through the model, outputs out.

`LLMEngine` is synchronous (LLM.generate drives it directly); `EngineThread` runs it on its own thread
behind thread-safe queues for the server. It is put together by engine/builder.py (`build_engine`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from localserve.engine.batch import Batch
from localserve.engine.beam_search import beam_search_step
from localserve.engine.config import EngineConfig
from localserve.engine.constraints import GrammarCompiler
from localserve.engine.embedding_params import EmbeddingParams
from localserve.engine.events import EventKind, EventLog
from localserve.engine.grammar_masks import GrammarMasks
from localserve.engine.model_runner import ModelRunner
from localserve.engine.multimodal import (
    MultiModalInputs,
    bidirectional_spans,
    block_extra_keys,
    image_spans,
)
from localserve.engine.outputs import RequestOutput, make_output
from localserve.engine.pooling import PromptPooling
from localserve.engine.request_checks import PROMPT_ONLY, RequestChecks
from localserve.engine.sampler import Sampler, SamplerOutput, SamplingRow, make_generator
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.scheduler import Scheduler
from localserve.engine.sequence import Request, Sequence
from localserve.engine.snapshot import EngineSnapshot, EngineStats, read_snapshot, read_stats
from localserve.engine.spec_acceptance import Verification, VerifyRow, verify
from localserve.engine.stop_reason import ABORT, ERROR, StopReason
from localserve.engine.stop_rules import append_sampled_token
from localserve.kv.block_manager import BlockManager

log = logging.getLogger(__name__)



@dataclass
class StepRecord:
    """What one step ran, kept for tests, benchmarks and the monitor."""

    num_tokens: int
    num_prefill_tokens: int
    num_seqs: int
    num_preempted: int
    duration_s: float


@dataclass(slots=True)
class SampledRow:
    """A sequence the sampler draws a next token for in this step, and the row of the step's logits it reads."""

    request: Request
    seq: Sequence
    logits_row: int


class LLMEngine:
    """Continuous batching over a paged KV pool for one model."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, block_manager: BlockManager, scheduler: Scheduler,
                 events: EventLog, tokenizer=None, *, max_model_len: int) -> None:
        """The engine over built parts (see build_engine): `config` with the pool's real size, the runner
        with its pool and backend, the block manager and the scheduler over it, the event log they append to."""
        self.config = config
        self.runner = runner
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.events = events
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_config = runner.model.config
        self.device = runner.device
        self.image_embeds = runner.image_embeds  # the embeddings of recent images (engine/multimodal.py)
        self.sampler = Sampler()
        self.eos_token_ids = set(self.model_config.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
        self.grammars = GrammarCompiler(tokenizer.backend if tokenizer else None, self.model_config.vocab_size,
                                        self.eos_token_ids)
        self.grammar_masks = GrammarMasks(self.model_config.vocab_size, self.device)
        scheduler_config = scheduler.config
        self.checks = RequestChecks(
            self.model_config, config, max_model_len, runner.model.can_generate, tokenizer is not None,
            self.grammars, block_manager, scheduler_config.max_num_seqs,
            scheduler_config.max_num_batched_tokens if scheduler_config.enable_chunked_prefill else None)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        self.step_history: deque[StepRecord] = deque(maxlen=100_000)
        self.num_prompt_tokens = 0  # prefilled (computed) tokens, all steps
        self.num_generation_tokens = 0
        self.num_requests_finished = 0
        self.num_steps = 0
        self.num_requests_failed = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | EmbeddingParams,
                    request_id: str | None = None, multimodal: MultiModalInputs | None = None) -> str:
        """Queue a request; raises ValueError (before any block is taken) if it can never run.

        With `EmbeddingParams` it is an embedding request: its prompt is prefilled (in chunks, batched with
        the rest), pooled, and its final output carries the vector (`RequestOutput.embedding`); nothing is
        sampled, and its blocks go back as soon as the prompt is done.

        `multimodal`: the prompt's images (engine/multimodal.py): spans of placeholder tokens whose input
        embeddings are the images', and those embeddings (or a callable making them on first use)."""
        arrival = next(self._arrivals)
        request_id = request_id if request_id is not None else f"req-{arrival}"
        try:
            self.validate(prompt_token_ids, params, multimodal)
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
        except ValueError as exc:
            self.events.append(EventKind.REJECTED, f"r{arrival}", reason=str(exc))
            raise
        if multimodal is not None and not multimodal.spans:
            multimodal = None
        if isinstance(params, EmbeddingParams):
            return self._add_request(self._add_embedding_request(prompt_token_ids, params, request_id, arrival),
                                     multimodal)
        seq = self._new_sequence(list(prompt_token_ids), len(prompt_token_ids), params.seed,
                                 with_decoder=not params.beam_search, skip_special_tokens=params.skip_special_tokens)
        seq.grammar = self.grammars.matcher(params)
        seq.in_reasoning = params.reasoning_end is not None
        request = Request(request_id, arrival, list(prompt_token_ids), params, [seq],
                          eos_ids=frozenset(() if params.ignore_eos else self.eos_token_ids),
                          max_num_tokens=min(len(prompt_token_ids) + params.max_tokens, self.max_model_len))
        return self._add_request(request, multimodal)

    def _add_request(self, request: Request, multimodal: MultiModalInputs | None) -> str:
        """Queue a made request, its images with it (each block's key part they make, kv/block_hash.py)."""
        if multimodal is not None:
            request.multimodal = multimodal
            request.block_extra_keys = block_extra_keys(multimodal.spans, self.config.block_size)
            request.bidirectional_spans = bidirectional_spans(multimodal.spans)
            request.image_spans = image_spans(multimodal.spans)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def _add_embedding_request(self, prompt_token_ids: list[int], params: EmbeddingParams, request_id: str,
                               arrival: int) -> Request:
        seq = self._new_sequence(list(prompt_token_ids), len(prompt_token_ids), None, with_decoder=False)
        pooling = PromptPooling(self.model_config.pooling, params.dimensions)
        request = Request(request_id, arrival, list(prompt_token_ids), PROMPT_ONLY, [seq],
                          max_num_tokens=len(prompt_token_ids), pooling=pooling,
                          uses_prefix_cache=not pooling.spec.method.reads_every_token)
        return request

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | EmbeddingParams,
                 multimodal: MultiModalInputs | None = None) -> None:
        """The checks add_request makes, usable on their own by a server before it commits to a request
        (engine/request_checks.py; they read only settings fixed at build: thread-safe)."""
        self.checks.check(prompt_token_ids, params, multimodal)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once; its blocks go back to the pool. Returns its final output (its unfinished
        samples stopped by "abort"); unknown or finished ids are ignored (None)."""
        request = self.requests.pop(request_id, None)
        if request is None or request.is_finished:
            return None
        live = request.live_seqs
        self.scheduler.finish(request)
        for seq in live:
            seq.finish_reason, seq.stop = "abort", ABORT
        self.num_requests_finished += 1
        self.events.append(EventKind.FINISHED, request.label, reason="abort")
        return make_output(request, True, self.tokenizer)

    def fail_request(self, request_id: str, reason: str) -> None:
        """End a request that cannot go on: its blocks go back, `reason` is its error. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.is_finished:
            self._fail(request, reason)
            self.num_requests_failed += 1

    def _fail(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request)
        request.error = reason
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason, seq.stop = "error", ERROR
        self.events.append(EventKind.FAILED, request.label, reason=reason)

    @contextlib.contextmanager
    def _serving(self, request: Request):
        """Fail only `request` if serving it raises; the step goes on for the others."""
        try:
            yield
        except Exception as exc:
            self._fail_alone(request, exc)

    def _fail_alone(self, request: Request, exc: Exception) -> None:
        log.exception("serving request %s failed; failing it alone", request.request_id)
        self._fail(request, f"internal error: {type(exc).__name__}: {exc}")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and report every request that moved."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        drafting_s = self._draft(batch) if batch.drafting is not None else 0.0
        encoding_s = self._encode_images(batch) if batch.has_images else 0.0
        masks = self.grammar_masks.start(batch.rows)  # filled while the model runs
        if batch.num_pooled_tokens:
            logits, hidden = self.runner.execute_pooled(batch.step_input)
        else:
            logits, hidden = self.runner.execute(batch.step_input), None
        if masks is not None:
            masks.apply(logits)
        outputs = self._postprocess(batch, logits, hidden)
        self.num_steps += 1
        duration = time.perf_counter() - start
        # The drafter's cost is learnt apart; the image encoder's is not the step's tokens' either.
        self.scheduler.observe_step(batch, duration - drafting_s - encoding_s)
        self.step_history.append(StepRecord(batch.num_tokens, batch.num_prefill_tokens, len(batch.rows),
                                            len(batch.preempted), duration))
        if self.config.check_integrity:
            self.block_manager.check_integrity()
        return outputs

    def _encode_images(self, batch: Batch) -> float:
        """Make the embeddings of the images the step's chunks overlap before the forward pass; a request whose
        images fail (its encoder raises, or gives embeddings of the wrong shape) fails alone: its rows leave
        the step. Returns the seconds it took; the scheduler's encoder cost learns from the images encoded
        (engine/encode_budget.py)."""
        start = time.perf_counter()
        cache = self.image_embeds
        tokens_before, seconds_before = cache.num_encoded_tokens, cache.encode_s
        failed: dict[str, tuple[Request, str]] = {}
        for row in batch.rows:
            request = row.request
            if row.chunk.multimodal is None or request.request_id in failed:
                continue
            try:
                self.runner.encode_images(row.chunk)
            except Exception as exc:
                log.exception("the images of request %s failed", request.request_id)
                reason = str(exc) if isinstance(exc, ValueError) else f"image encoder: {type(exc).__name__}: {exc}"
                failed[request.request_id] = (request, reason)
        if failed:
            batch.drop_requests(request for request, _ in failed.values())
            for request, reason in failed.values():
                self._fail(request, reason)
                batch.failed.append(request)
        self.scheduler.observe_encode(cache.num_encoded_tokens - tokens_before, cache.encode_s - seconds_before)
        return time.perf_counter() - start

    def _draft(self, batch: Batch) -> float:
        """The drafts the schedule asked for (engine/speculation.py), made by its drafter (a draft model's
        forward passes run here, between the schedule and the target's forward pass) and handed back to
        the scheduler, which completes the step; returns the seconds the drafter took."""
        drafting = batch.drafting
        start = time.perf_counter()
        drafts = drafting.drafter.propose(drafting.queries)
        drafting_s = time.perf_counter() - start
        self.scheduler.add_drafts(batch, drafts, drafting_s)
        return drafting_s

    def _postprocess(self, batch: Batch, logits: torch.Tensor, hidden: torch.Tensor | None) -> list[RequestOutput]:
        self.scheduler.mark_computed(batch)
        moved: dict[str, Request] = {request.request_id: request for request in batch.failed}
        if hidden is not None:
            self._pool(batch, hidden, moved)
        sampled: list[SampledRow] = []
        beam_rows: dict[str, list[SampledRow]] = {}  # each beam-search request's live beams
        verified: list[VerifyRow] = []  # speculative decoding's verify rows (engine/speculation.py)
        num_logits_rows = 0
        num_prompt_tokens = 0
        for scheduled in batch.rows:
            request, seq, num_tokens = scheduled.request, scheduled.seq, scheduled.query_len
            if scheduled.num_draft_tokens:
                moved[request.request_id] = request
                draft = self.scheduler.take_draft(scheduled)  # a decode row again
                verified.append(VerifyRow(request, seq, num_logits_rows, draft.token_ids, draft.probs))
                num_logits_rows += len(draft.token_ids) + 1
                continue
            if num_tokens > 1 or len(seq.token_ids) == seq.prompt_len:
                num_prompt_tokens += num_tokens
            if not scheduled.chunk.needs_logits:
                continue
            moved[request.request_id] = request
            row = SampledRow(request, seq, num_logits_rows)
            num_logits_rows += 1
            if request.beam_search:
                beam_rows.setdefault(request.request_id, []).append(row)
                continue
            sampled.append(row)
            if not request.forked:
                sampled += self._fork_samples(row)
        self.num_prompt_tokens += num_prompt_tokens
        if sampled:
            # Without forks, beams or verify rows every logits row is one sampled row, in order: the sampler
            # reads them in place; else the row index is built once, on the device.
            identity = len(sampled) == num_logits_rows and not beam_rows and not verified
            index = None if identity else torch.tensor([row.logits_row for row in sampled], device=logits.device)
            rows = [row.seq.sampling_row or self._sampling_row(row.request, row.seq) for row in sampled]
            self._append_sampled(sampled, self.sampler(logits, rows, index))
        if verified:
            verifications = verify(logits, verified)
            # Recurrent layers (a state group) write a verify row's states only now, for its kept tokens.
            self.runner.settle_states({row.seq.seq_id: 1 + verification.num_accepted
                                       for row, verification in zip(verified, verifications, strict=True)})
            self._append_verified(verified, verifications)
        for beams in beam_rows.values():
            self._beam_step(beams, logits)
        return self._report(moved.values())

    def _pool(self, batch: Batch, hidden: torch.Tensor, moved: dict[str, Request]) -> None:
        """Pool each embedding chunk's hidden states (rows of `hidden` in chunk order); a prompt whose last
        chunk this was has its vector, ends, and gives its blocks back (its full blocks stay cached)."""
        offset = 0
        for row in batch.rows:
            chunk = row.chunk
            if not chunk.needs_hidden:
                continue
            request, seq = row.request, row.seq
            with self._serving(request):
                request.pooling.add(hidden[offset:offset + row.query_len], chunk.start_pos)
                if chunk.context_len == seq.num_tokens:
                    request.embedding = request.pooling.vector()
                    self._end_seq(seq, "stop")
            if request.embedding is not None or request.error is not None:  # done, or failed alone
                moved[request.request_id] = request
            offset += row.query_len

    def _fork_samples(self, first: SampledRow) -> list[SampledRow]:
        """The request's samples 2..n, forked from its first at its first sampled step (sharing its blocks);
        they read the first's logits row."""
        request = first.request
        request.forked = True
        forks: list[SampledRow] = []
        with self._serving(request):
            for index in range(1, request.params.n):
                forks.append(SampledRow(request, self.fork(request, first.seq, index), first.logits_row))
        return forks

    def _beam_step(self, beams: list[SampledRow], logits: torch.Tensor) -> None:
        """One beam-search step for the request of `beams` (its beams computed this step), once every live
        beam has its next-token logits."""
        request = beams[0].request
        for beam in beams:
            request.beam_logits[beam.seq.seq_id] = logits[beam.logits_row].clone()
        # After a preemption by recompute the beams are prefilled again one by one and may finish in
        # different steps: a beam step needs the next-token logits of every live beam at once.
        if any(seq.seq_id not in request.beam_logits for seq in request.live_seqs):
            return
        live = request.live_seqs
        beam_logits = torch.stack([request.beam_logits.pop(seq.seq_id) for seq in live])
        request.forked = True
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            self.events.append(EventKind.FIRST_TOKEN, request.label)
        with self._serving(request):
            beam_search_step(self, request, [(seq, i) for i, seq in enumerate(live)], beam_logits)

    @staticmethod
    def _sampling_row(request: Request, seq: Sequence) -> SamplingRow:
        """The sequence's row for the sampler, made once: its output is a live view, nothing is copied."""
        seq.sampling_row = SamplingRow(request.params, seq.generator, request.prompt_token_ids,
                                       seq.output_span(live=True))
        return seq.sampling_row

    def _new_sequence(self, token_ids: list[int], prompt_len: int, seed: int | None,
                      with_decoder: bool = True, skip_special_tokens: bool = True) -> Sequence:
        decoder = (self.tokenizer.stream_decoder(skip_special_tokens) if self.tokenizer is not None and with_decoder
                   else None)
        return Sequence(next(self._seq_ids), prompt_len, token_ids, make_generator(seed, self.device),
                        decoder=decoder)

    def copy_sequence(self, parent: Sequence, seed: int | None = None) -> Sequence:
        """A new sequence with the same tokens and scores as `parent`, holding no blocks yet.

        It streams text only if it starts before any output (parallel samples); beams, which branch
        mid-way, are detokenized when they finish.
        """
        child = self._new_sequence(list(parent.token_ids), parent.prompt_len, seed,
                                   with_decoder=parent.decoder is not None and not parent.output_token_ids,
                                   skip_special_tokens=getattr(parent.decoder, "skip_special_tokens", True))
        child.num_computed_tokens = parent.num_computed_tokens
        child.cumulative_logprob = parent.cumulative_logprob
        child.logprobs, child.top_logprobs = list(parent.logprobs), list(parent.top_logprobs)
        child.text = parent.text
        child.grammar = parent.grammar.fork() if parent.grammar is not None else None
        child.in_reasoning, child.num_reasoning_tokens = parent.in_reasoning, parent.num_reasoning_tokens
        return child

    def fork(self, request: Request, parent: Sequence, index: int = 0) -> Sequence:
        """A new sequence of `request` sharing all of `parent`'s blocks (a parallel sample or a beam)."""
        seed = None if request.params.seed is None else request.params.seed + index
        child = self.copy_sequence(parent, seed)
        self.block_manager.fork(parent.seq_id, child.seq_id, child.token_ids)
        request.seqs.append(child)
        return child

    def _append_sampled(self, sampled: list[SampledRow], result: SamplerOutput) -> None:
        """Add each sampled token to its sequence (engine/stop_rules.py), which may end there. A request
        whose bookkeeping raises fails alone and the loop goes on with the next row (one try around
        the loop, not a guard per token: entering a try costs nothing, a context manager a microsecond)."""
        self.num_generation_tokens += len(sampled)
        entries = zip(sampled, result.token_ids, result.logprobs, result.top_logprobs or itertools.repeat(None))
        row = None
        while True:
            try:
                for row, token_id, logprob, top in entries:
                    request = row.request
                    if request.error is not None:  # failed alone earlier in this step
                        continue
                    reason = append_sampled_token(request, row.seq, token_id, logprob, top)
                    request.just_readmitted = False
                    if request.first_token_time is None:
                        request.first_token_time = time.monotonic()
                        self.events.append(EventKind.FIRST_TOKEN, request.label)
                    if reason is not None:
                        self._finish_seq(row.seq, reason)
                return
            except Exception as exc:
                self._fail_alone(row.request, exc)

    def _append_verified(self, rows: list[VerifyRow], verifications: list[Verification]) -> None:
        """Add each verification's tokens to its sequence one by one (stop rules apply to each: a stop
        inside the accepted draft ends the sequence there), then let the block manager keep what was
        accepted (engine/speculation.py). Failures as in `_append_sampled`."""
        entries = zip(rows, verifications)
        row = None
        while True:
            try:
                for row, verification in entries:
                    request, seq = row.request, row.seq
                    if request.error is not None:
                        continue
                    reason = None
                    for token_id, logprob, top in zip(verification.token_ids, verification.logprobs,
                                                      verification.top_logprobs):
                        reason = append_sampled_token(request, seq, token_id, logprob, top)
                        self.num_generation_tokens += 1
                        if reason is not None:
                            break
                    request.just_readmitted = False
                    if reason is not None:
                        self._finish_seq(seq, reason)
                    self.scheduler.settle_draft(seq, len(row.draft), verification.num_accepted)
                return
            except Exception as exc:
                self._fail_alone(row.request, exc)

    def _finish_seq(self, seq: Sequence, stop: StopReason) -> None:
        seq.stop = stop
        self._end_seq(seq, stop.finish_reason)

    def _end_seq(self, seq: Sequence, finish_reason: str) -> None:
        seq.finish_reason = finish_reason
        seq.pending_append = False
        self.block_manager.free(seq.seq_id)  # a finished sample gives its blocks back at once

    def _report(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """Each request's output for this step; a request whose sequences have all finished leaves."""
        outputs = []
        for request in requests:
            finished = not request.live_seqs
            if finished:
                self.scheduler.finish(request)
                self.requests.pop(request.request_id, None)
                if request.error is not None:
                    self.num_requests_failed += 1  # the scheduler logged the failed event
                else:
                    self.num_requests_finished += 1
                    best = request.finished_beams or request.seqs
                    self.events.append(EventKind.FINISHED, request.label,
                                       reason=best[0].finish_reason if best else "stop")
            outputs.append(make_output(request, finished, self.tokenizer))
        return outputs

    # ------------------------------------------------------------------ convenience
    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; returns each request's final output."""
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        return final

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.preemption.num_preemptions

    def snapshot(self) -> EngineSnapshot:
        """Every block, every request and the statistics, as of now (call on the engine thread)."""
        return read_snapshot(self)

    def stats(self) -> EngineStats:
        """Gauges and counters, as of now (call on the engine thread)."""
        return read_stats(self)

    def is_idle_and_clean(self) -> bool:
        """No request holds a block: every block is free or cached, and the books balance."""
        self.block_manager.check_integrity()
        return not self.has_unfinished_requests() and self.block_manager.num_used_blocks == 0
