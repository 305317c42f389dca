"""Checks of every engine step against the scheduler's rules, for tests that drive an `LLMEngine`.

`StepChecker(engine)` wraps the engine's scheduler and model runner; the test calls `after_step()`
after each `engine.step()`. Every step is then checked for:
- the token budget, and `max_num_seqs` counting samples and beams;
- each request in exactly one queue matching its state, its sequences in the block manager exactly
  when it holds blocks (GPU while running, CPU while swapped), finished sequences nowhere;
- block moves: the step's swaps and copies are replayed in the model runner's order (swap-out,
  swap-in, copy-on-write) on a model of the pool in which every block holds the token prefix whose KV
  it stands for. Each chunk must then read exactly its own prefix, so a copy or swap naming a block
  that another move of the step freed or handed out shows up as a wrong read. Besides, each
  copy-on-write pair belongs to a sequence that runs in the step, no copy touches a block a swap of
  the step moves, and a preempted request has nothing left in the step and was not readmitted
  without sampling since;
- progress: a step taken while there is work computes at least one token, swaps a request in, or
  fails a request.
"""

from __future__ import annotations

from localserve.engine.engine import LLMEngine
from localserve.engine.scheduler import Batch
from localserve.engine.sequence import Request

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
        schedule, execute = engine.scheduler.schedule, engine.runner.execute

        def checked_schedule() -> Batch:
            self.had_work = engine.scheduler.has_work()
            self.batch = schedule()
            self.check_moves(self.batch)
            return self.batch

        def checked_execute(step_input):
            assert step_input is self.batch.step_input
            self.replay(self.batch)
            return execute(step_input)

        engine.scheduler.schedule = checked_schedule
        engine.runner.execute = checked_execute

    # ---- when the step is scheduled ----
    def check_moves(self, batch: Batch) -> None:
        step, bm = batch.step_input, self.engine.block_manager
        swapped_out = {gpu for gpu, _ in step.swap_out}
        swapped_in = {gpu for _, gpu in step.swap_in}
        assert not {cpu for _, cpu in step.swap_out} & {cpu for cpu, _ in step.swap_in}, \
            f"a CPU block is swapped out to and in from in one step: {step.swap_out} {step.swap_in}"
        # A copy-on-write pair: the block a sample of the step starts writing into, and the original a
        # sibling still holds at the same place.
        legit = set()
        for seq, request in zip(batch.seqs, batch.requests):
            index = seq.num_computed_tokens // self.block_size
            for sibling in request.live_seqs:
                table = bm.block_table(sibling.seq_id)
                if sibling is not seq and index < len(table):
                    legit.add((table[index], bm.block_table(seq.seq_id)[index]))
        for source, destination in step.block_copies:
            assert (source, destination) in legit, \
                f"copy {source}->{destination} is no copy-on-write of a sequence in the step (a withdrawn append?)"
            assert bm.ref_count(destination) == 1, f"copy-on-write destination {destination} is shared"
            assert not {source, destination} & swapped_in and source not in swapped_out, \
                f"copy {source}->{destination} touches a block swapped in this step or read by a swap-out"
        scheduled = {id(seq) for seq in batch.seqs}
        assert len(scheduled) == len(batch.seqs), "a sequence is scheduled twice"
        for victim in batch.preempted:
            assert not scheduled & {id(seq) for seq in victim.seqs}, f"preempted {victim.label} still in the step"

    def replay(self, batch: Batch) -> None:
        """Make the step's moves and writes on the pool model, checking every read first."""
        step, size = batch.step_input, self.block_size
        # Each kind of move reads all its sources before writing, as the pool's indexed copies do.
        out = [(cpu, self.gpu_kv[gpu]) for gpu, cpu in step.swap_out]
        for cpu, kv in out:
            self.cpu_kv[cpu] = kv
        back = [(gpu, self.cpu_kv[cpu]) for cpu, gpu in step.swap_in]
        for gpu, kv in back:
            self.gpu_kv[gpu] = kv
        copies = [(destination, self.gpu_kv[source]) for source, destination in step.block_copies]
        for destination, kv in copies:
            self.gpu_kv[destination] = kv
        prefixes = [tuple(seq.token_ids) for seq in batch.seqs]
        for seq, chunk, tokens in zip(batch.seqs, step.chunks, prefixes):
            assert tokens[chunk.start_pos:chunk.context_len] == tuple(chunk.token_ids), f"seq {seq.seq_id}"
            for index in range(-(-chunk.start_pos // size)):
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

    # ---- after the step ----
    def after_step(self) -> None:
        engine, batch = self.engine, self.batch
        scheduler, config = engine.scheduler, engine.scheduler.config
        engine.block_manager.check_integrity()
        budget = config.max_num_batched_tokens
        prefills = [q for q in batch.query_lens if q > 1]
        if batch.num_tokens > budget:  # only a whole prompt, alone among prefills, when chunking is off
            assert not config.enable_chunked_prefill and len(prefills) == 1, \
                f"{batch.num_tokens} tokens in a step, budget {budget}"
            assert batch.num_tokens - prefills[0] <= budget
        num_running = sum(len(r.live_seqs) for r in scheduler.running)
        assert num_running <= config.max_num_seqs, f"{num_running} sequences running, max {config.max_num_seqs}"
        assert len(batch.seqs) <= config.max_num_seqs
        for victim in batch.preempted:  # anti-thrashing: readmitted requests sample before they go again
            assert not victim.just_readmitted, f"{victim.label} preempted again before it sampled"
        if self.had_work:  # a request swapped in decodes in the next step
            assert batch.num_tokens > 0 or batch.failed or batch.step_input.swap_in, "a step with work did nothing"
        self.check_states()

    def check_states(self) -> None:
        engine, scheduler, bm = self.engine, self.engine.scheduler, self.engine.block_manager
        for request in engine.requests.values():
            self.known[id(request)] = request
        queued: dict[int, str] = {}
        for name, queue in (("waiting", scheduler.waiting), ("running", scheduler.running),
                            ("swapped", scheduler.swapped)):
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
