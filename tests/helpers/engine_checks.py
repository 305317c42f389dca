"""Checks of every engine step against the scheduler's rules, for tests that drive an `LLMEngine`.

`StepChecker(engine)` wraps the engine's scheduler and model runner; the test calls `after_step()`
after each `engine.step()`. Every step is then checked for:
- its rows: each one sequence of its request with that sequence's chunk, the step input's chunks the
  rows' in row order, the batch's token counts their sum;
- the token budget, and `max_num_seqs` counting samples and beams;
- each request in exactly one queue matching its state, its sequences in the block manager exactly
  when it holds blocks (GPU while running, CPU while swapped), finished sequences nowhere;
- block moves: the step's swaps and copies are replayed in the model runner's order (swap-out,
  swap-in, copy-on-write) on a model of the pool in which every block holds the token prefix whose KV
  it stands for. Each chunk must then read exactly its own prefix, so a copy or swap naming a block
  that another move of the step freed or handed out shows up as a wrong read. Besides, each
  copy-on-write pair belongs to a sequence that runs in the step, no copy touches a block a swap of
  the step moves, and a preempted request has nothing left in the step and was not readmitted
  without sampling since (with layer groups: group 0's moves on its model; every group's books by the
  integrity check);
- progress: a step taken while there is work computes at least one token, swaps a request in, or
  fails a request;
- order (docs/ARCHITECTURE.md, "Scheduling rules"): requests are admitted or readmitted (new,
  preempted by recompute, swapped out) in arrival order, and none while an earlier one still waits,
  so a preempted request comes back before every request that arrived after it;
- victims: a step preempts only when the pending appends of the running requests need more blocks
  than are available, and each victim is the newest request still running except those readmitted
  and not yet sampled since (anti-thrashing), which are never victims;
- work conservation: every running sequence with tokens to compute gets them all unless the token
  budget ran out (without chunked prefill: unless its whole prompt no longer fits beside another
  prefill; a bidirectional image span: unless its rest does not fit, engine/batch.py), and, in a step
  that did not preempt, the oldest request still waiting or swapped does not fit by the admission rule
  (slots, a token left for a prompt, its blocks plus one block of headroom per running sequence and its
  own growth), which the checker works out on its own.
"""

from __future__ import annotations

import os

from localserve.engine.admission import peak_blocks
from localserve.engine.batch import Batch
from localserve.engine.engine import LLMEngine
from localserve.engine.events import EventKind
from localserve.engine.sequence import Request, Sequence
from localserve.kv.layer_groups import num_blocks_out_of_window

CORRUPT = (-1,)  # a block written mid-way over contents that were not this sequence's prefix


class StepChecker:
    """Wraps one engine's scheduler and runner to check every step it takes (see the module doc)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        bm = engine.block_manager
        self.block_size = bm.block_size
        self.gpu_kv: list[tuple[int, ...] | None] = [None] * bm.num_blocks
        self.cpu_kv: list[tuple[int, ...] | None] = [None] * bm.num_cpu_blocks
        self.batch: Batch | None = None
        self.had_work = False
        self.known: dict[int, Request] = {}  # every request the engine has held, by id()
        schedule, add_drafts, execute = engine.scheduler.schedule, engine.scheduler.add_drafts, engine.runner.execute
        scheduled_from: tuple = ()  # what the step's checks read from before it was scheduled

        def check_scheduled(batch: Batch) -> None:
            before, last_event = scheduled_from
            self.check_rows(batch)
            self.check_moves(batch)
            self.check_admission_order(last_event)
            self.check_victims(batch, before)
            self.check_work_conserving(batch)

        def checked_schedule() -> Batch:
            nonlocal scheduled_from
            self.had_work = engine.scheduler.has_work()
            scheduled_from = (self.running_before(), engine.events.last_seq)
            self.batch = schedule()
            if self.batch.drafting is None:  # complete as scheduled; else once its drafts are in
                check_scheduled(self.batch)
            return self.batch

        def checked_add_drafts(batch: Batch, drafts, drafting_s: float) -> None:
            add_drafts(batch, drafts, drafting_s)
            check_scheduled(batch)

        def checked_execute(step_input):
            assert step_input is self.batch.step_input
            self.replay(self.batch)
            return execute(step_input)

        engine.scheduler.schedule = checked_schedule
        engine.scheduler.add_drafts = checked_add_drafts
        engine.runner.execute = checked_execute

    # ---- when the step is scheduled ----
    def check_rows(self, batch: Batch) -> None:
        """Each row is one sequence of its request with its chunk, and the runner reads the rows' chunks."""
        step = batch.step_input
        assert len(step.chunks) == len(batch.rows) and all(
            chunk is row.chunk for chunk, row in zip(step.chunks, batch.rows)), "the step input's chunks are another's"
        for row in batch.rows:
            assert any(seq is row.seq for seq in row.request.seqs), f"seq {row.seq.seq_id} is not its row's request's"
            assert row.chunk.seq_id == row.seq.seq_id and row.query_len == len(row.chunk.token_ids) > 0, \
                f"seq {row.seq.seq_id}: its row's chunk is another's, or of another length"
            if row.num_draft_tokens:  # a verify row: a decode row whose last num_draft_tokens tokens are a draft
                assert row.chunk.num_draft_tokens == row.num_draft_tokens and row.chunk.needs_logits and \
                    row.seq.num_computed_tokens == row.chunk.start_pos == len(row.seq.token_ids) - row.query_len, \
                    f"seq {row.seq.seq_id}: a verify row that is no decode row and its draft"
        lens = [row.query_len for row in batch.rows if not row.num_draft_tokens]
        drafted = sum(row.num_draft_tokens for row in batch.rows)
        num_verified = sum(row.query_len for row in batch.rows if row.num_draft_tokens)
        assert batch.num_tokens == sum(lens) + num_verified and batch.num_draft_tokens == drafted and \
            batch.num_prefill_tokens == sum(q for q in lens if q > 1), \
            f"the batch counts {batch.num_tokens} tokens, {batch.num_prefill_tokens} in prefills, " \
            f"{batch.num_draft_tokens} drafted; its rows: {[row.query_len for row in batch.rows]}, {drafted} drafted"

    def check_moves(self, batch: Batch) -> None:
        step, bm = batch.step_input, self.engine.block_manager
        swapped_out = {gpu for gpu, _, group in step.swap_out if group == 0}
        swapped_in = {gpu for _, gpu, group in step.swap_in if group == 0}
        assert not {(cpu, g) for _, cpu, g in step.swap_out} & {(cpu, g) for cpu, _, g in step.swap_in}, \
            f"a CPU block is swapped out to and in from in one step: {step.swap_out} {step.swap_in}"
        # A copy-on-write pair: the block a sample of the step starts writing into, and the original a
        # sibling still holds at the same place.
        legit = set()
        for row in batch.rows:
            seq, request = row.seq, row.request
            index = seq.num_computed_tokens // self.block_size
            for sibling in request.live_seqs:
                table = bm.block_table(sibling.seq_id)
                if sibling is not seq and index < len(table):
                    legit.add((table[index], bm.block_table(seq.seq_id)[index]))
        for source, destination, _ in [move for move in step.block_copies if move[2] == 0]:
            assert (source, destination) in legit, \
                f"copy {source}->{destination} is no copy-on-write of a sequence in the step (a withdrawn append?)"
            assert bm.ref_count(destination) == 1, f"copy-on-write destination {destination} is shared"
            assert not {source, destination} & swapped_in and source not in swapped_out, \
                f"copy {source}->{destination} touches a block swapped in this step or read by a swap-out"
        scheduled = {id(row.seq) for row in batch.rows}
        assert len(scheduled) == len(batch.rows), "a sequence is scheduled twice"
        for victim in batch.preempted:
            assert not scheduled & {id(seq) for seq in victim.seqs}, f"preempted {victim.label} still in the step"

    def replay(self, batch: Batch) -> None:
        """Make the step's moves and writes on the pool model, checking every read first."""
        step, size = batch.step_input, self.block_size
        # Each kind of move reads all its sources before writing, as the pool's indexed copies do.
        out = [(cpu, self.gpu_kv[gpu]) for gpu, cpu, group in step.swap_out if group == 0]
        for cpu, kv in out:
            self.cpu_kv[cpu] = kv
        back = [(gpu, self.cpu_kv[cpu]) for cpu, gpu, group in step.swap_in if group == 0]
        for gpu, kv in back:
            self.gpu_kv[gpu] = kv
        copies = [(destination, self.gpu_kv[source]) for source, destination, group in step.block_copies if group == 0]
        for destination, kv in copies:
            self.gpu_kv[destination] = kv
        prefixes = [tuple(row.seq.token_ids) for row in batch.rows]
        window = self.engine.block_manager.group_windows[0]  # group 0 of a model whose every layer has a window
        for row, chunk, tokens in zip(batch.rows, step.chunks, prefixes):
            seq = row.seq
            assert tokens[chunk.start_pos:chunk.context_len] == tuple(chunk.token_ids), f"seq {seq.seq_id}"
            for index in range(num_blocks_out_of_window(chunk.start_pos, window, size), -(-chunk.start_pos // size)):
                end = min(chunk.start_pos, (index + 1) * size)
                held = self.gpu_kv[chunk.block_table[index]]
                assert held is not None and held[:end] == tokens[:end] and len(held) >= end, \
                    f"seq {seq.seq_id} reads block {chunk.block_table[index]} (logical {index}) holding " \
                    f"{'nothing' if held is None else f'a different prefix of {len(held)} tokens'}"
        for chunk, tokens in zip(step.chunks, prefixes):
            for index in range(chunk.start_pos // size, -(-chunk.context_len // size)):
                start, end = max(chunk.start_pos, index * size), min(chunk.context_len, (index + 1) * size)
                block = chunk.block_table[index]
                held = self.gpu_kv[block]
                intact = start == index * size or (held is not None and held[:start] == tokens[:start])
                self.gpu_kv[block] = tokens[:end] if intact else CORRUPT

    # ---- order, victims and work conservation, right after schedule() ----
    def running_before(self) -> tuple[list[Request], set[int], int, int]:
        """Before schedule(): the running requests, those protected from preemption (readmitted, not
        sampled since), the blocks their pending appends need, and the blocks available."""
        scheduler, bm = self.engine.scheduler, self.engine.block_manager
        running = sorted(scheduler.queues.running, key=lambda r: r.arrival)
        pending = [seq.seq_id for r in running for seq in r.live_seqs if seq.pending_append]
        need = bm.num_blocks_to_append(pending) if pending else 0
        return running, {id(r) for r in running if r.just_readmitted}, need, bm.num_available_blocks

    def check_admission_order(self, last_event: int) -> None:
        events, missed = self.engine.events.since(last_event)
        assert not missed
        admitted = [int(e.request[1:]) for e in events if e.kind in (EventKind.ADMITTED, EventKind.RESUMED)]
        assert admitted == sorted(admitted), f"(re)admitted out of arrival order: {admitted}"
        scheduler = self.engine.scheduler
        still_waiting = [r.arrival for r in scheduler.queues.waiting + scheduler.queues.swapped]
        if admitted and still_waiting:
            assert max(admitted) < min(still_waiting), \
                f"r{max(admitted)} (re)admitted while r{min(still_waiting)}, which arrived before it, still waits"

    def check_victims(self, batch: Batch, before: tuple[list[Request], set[int], int, int]) -> None:
        running, protected, need, available = before
        if batch.preempted:
            assert need > available, f"preempted with {available} blocks available for appends needing {need}"
        remaining = [r for r in running if r not in batch.failed]
        for victim in batch.preempted:
            assert id(victim) not in protected, f"{victim.label} preempted again before it sampled"
            assert victim in remaining, f"{victim.label} preempted but was not running"
            remaining.remove(victim)
            spared = [r.label for r in remaining if r.arrival > victim.arrival and id(r) not in protected]
            assert not spared, f"{victim.label} preempted while newer {spared} kept running"

    def check_work_conserving(self, batch: Batch) -> None:
        scheduler, bm = self.engine.scheduler, self.engine.block_manager
        config = scheduler.config
        left = config.max_num_batched_tokens - batch.num_tokens
        scheduled = {id(row.seq): row.query_len for row in batch.rows}
        for request in scheduler.queues.running:
            for seq in request.live_seqs:
                if seq.pending_append or seq in request.followers:
                    continue  # swapped in by this step (decodes from the next), or waiting for its leader
                todo, done = seq.num_uncomputed_tokens, scheduled.get(id(seq), 0)
                # A window layer group gives a prompt slots a chunk at a time: a chunk ends there at most.
                todo = min(todo, bm.num_slotted_tokens(seq.seq_id) - seq.num_computed_tokens)
                if done == todo or _stopped_at_a_span(request, seq.num_computed_tokens + done, left):
                    continue
                if config.enable_chunked_prefill or todo == 1:
                    assert left <= 0, f"seq {seq.seq_id} of {request.label} got {done} of its {todo} tokens " \
                                      f"with {left} of the budget left"
                else:
                    assert done == 0 and todo > left and batch.num_prefill_tokens > 0, \
                        f"seq {seq.seq_id} of {request.label}: prompt of {todo} left out, {left} of the budget left"
        queued = scheduler.queues.waiting + scheduler.queues.swapped
        if batch.preempted or not queued:
            return
        head = min(queued, key=lambda r: r.arrival)
        seqs = head.live_seqs
        slots_in_use = sum(len(r.live_seqs) if r.forked else r.params.n for r in scheduler.queues.running)
        slots = len(seqs) if head.forked else head.params.n
        if head in scheduler.queues.swapped:
            needs = bm.group_blocks_to_swap_in([seq.seq_id for seq in seqs])
        else:
            shared = _shared_blocks(seqs, bm.block_size) if bm.shares_uncomputed_blocks else 0
            others = sum(-(-seq.num_tokens // bm.block_size) - shared for seq in seqs[1:])
            needs = [need + others for need in bm.group_blocks_to_allocate(seqs[0].token_ids)]
        peak = peak_blocks(len(head.prompt_token_ids), head.params.max_tokens, slots, bm.block_size)
        # In each layer group's pool: its blocks now, a block per running slot, and its own growth.
        blocks_fit = all(need + slots_in_use + min(slots, max(0, peak - need)) <= available
                         for need, available in zip(needs, bm.group_available_blocks, strict=True))
        fits = (slots_in_use + slots <= config.max_num_seqs and (head in scheduler.queues.swapped or left > 0)
                and blocks_fit)
        assert not fits, f"{head.label} waits though it fits: {slots_in_use} + {slots} of {config.max_num_seqs} " \
                         f"slots, {left} tokens of the budget left, needs {needs} + {slots_in_use} of " \
                         f"{bm.group_available_blocks} blocks"

    # ---- after the step ----
    def after_step(self) -> None:
        engine, batch = self.engine, self.batch
        scheduler, config = engine.scheduler, engine.scheduler.config
        engine.block_manager.check_integrity()
        budget = config.max_num_batched_tokens
        prefills = [row.query_len for row in batch.rows if row.query_len > 1]
        if batch.num_tokens > budget:  # only a whole prompt, alone among prefills, when chunking is off
            if config.enable_chunked_prefill:  # or the rest of a bidirectional span, the step's first prefill
                first = next((row for row in batch.rows if row.query_len > 1 and not row.num_draft_tokens), None)
                assert first is not None, f"{batch.num_tokens} tokens in a step, budget {budget}"
                start, end = first.chunk.start_pos, first.chunk.start_pos + first.query_len
                assert any(offset <= start and end == span_end for offset, span_end in
                           first.request.bidirectional_spans), f"{batch.num_tokens} tokens in a step, budget {budget}"
                assert batch.num_tokens - first.query_len < budget
            else:
                assert len(prefills) == 1, f"{batch.num_tokens} tokens in a step, budget {budget}"
                assert batch.num_tokens - prefills[0] <= budget
        num_running = sum(len(r.live_seqs) for r in scheduler.queues.running)
        assert num_running <= config.max_num_seqs, f"{num_running} sequences running, max {config.max_num_seqs}"
        assert len(batch.rows) <= config.max_num_seqs
        if self.had_work:  # a request swapped in decodes in the next step
            assert batch.num_tokens > 0 or batch.failed or batch.step_input.swap_in, "a step with work did nothing"
        self.check_states()

    def check_states(self) -> None:
        engine, scheduler, bm = self.engine, self.engine.scheduler, self.engine.block_manager
        for request in engine.requests.values():
            self.known[id(request)] = request
        queued: dict[int, str] = {}
        for name, queue in (("waiting", scheduler.queues.waiting), ("running", scheduler.queues.running),
                            ("swapped", scheduler.queues.swapped)):
            for request in queue:
                assert id(request) not in queued, f"{request.label} is {queued[id(request)]} and {name}"
                queued[id(request)] = name
                assert request.state.value == name, f"{request.label} in {name}, state {request.state}"
                assert engine.requests.get(request.request_id) is request
        seq_ids: set[int] = set()
        for request in self.known.values():
            place = queued.get(id(request), "finished")
            assert (place == "finished") == request.is_finished, f"{request.label}: {place}, {request.state}"
            for seq in request.seqs + request.finished_beams:
                assert seq.seq_id not in seq_ids, f"sequence {seq.seq_id} belongs to two requests"
                seq_ids.add(seq.seq_id)
                holds = place in ("running", "swapped") and not seq.finished
                try:
                    swapped = bm.is_swapped(seq.seq_id)
                except KeyError:
                    assert not holds, f"{request.label} is {place} but seq {seq.seq_id} holds no blocks"
                else:
                    assert holds and swapped == (place == "swapped"), \
                        f"seq {seq.seq_id} of {request.label} ({place}, finished {seq.finished}) has " \
                        f"{'CPU' if swapped else 'GPU'} blocks"


def _stopped_at_a_span(request: Request, end: int, left: int) -> bool:
    """Whether a prefill chunk ending at `end` (with `left` of the step's budget left) stopped by the rule of
    bidirectional image spans (engine/batch.py, `span_safe_chunk`): at the start of such a span, or (a chunk
    of nothing) inside one after a prefix hit, whose rest does not fit what the budget left."""
    return any(offset <= end < span_end and span_end - end > left for offset, span_end in request.bidirectional_spans)


def _shared_blocks(seqs: list[Sequence], block_size: int) -> int:
    """Full blocks of the sequences' common prefix, each keeping at least its last token to compute."""
    common = len(os.path.commonprefix([seq.token_ids for seq in seqs]))
    return min(common, min(seq.num_tokens for seq in seqs) - 1) // block_size


def run_requests(engine: LLMEngine, requests, check: bool, max_steps: int = 5000) -> list:
    """Add every (prompt, params) of `requests`, step until all finish (each step checked by a StepChecker
    when `check`), and return their final outputs in order; the engine must end idle and clean."""
    checker = StepChecker(engine) if check else None
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        final.update((output.request_id, output) for output in engine.step() if output.finished)
        if checker:
            checker.after_step()
    assert engine.is_idle_and_clean()
    return [final[request_id] for request_id in ids]


def run_greedy(model, work, check: bool = True, draft_model=None, **config) -> tuple[list, LLMEngine]:
    """Each request's generated ids from an engine built for `model` (a pool of 256 blocks, 16 sequences, 64
    tokens a step unless `config` says otherwise; every step checked when `check`), and the engine. A
    speculative engine drafts whatever this machine's speed (a fixed step cost)."""
    from localserve.engine.builder import build_engine
    from localserve.engine.config import EngineConfig
    from tests.helpers.spec_costs import FixedStepCost

    config = {"num_kv_blocks": 256, "max_num_seqs": 16, "max_num_batched_tokens": 64, "check_integrity": check} | config
    engine = build_engine(model, None, EngineConfig(**config), draft_model=draft_model)
    if engine.scheduler.speculation is not None:
        engine.scheduler.speculation.cost = FixedStepCost()
    return [output.outputs[0].token_ids for output in run_requests(engine, work, check)], engine
