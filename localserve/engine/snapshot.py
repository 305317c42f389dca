"""Typed snapshots of the engine (no torch here): every block's state, the requests, gauges, counters.

Built on the engine thread between steps (`LLMEngine.snapshot()`, `LLMEngine.stats()`); `/v1/monitor`,
`/slots`, `/metrics` and the TUI read only these and the event log (localserve.engine.events).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from localserve.engine.speculation import SpecTotals, spec_totals
from localserve.kv.block_books import GroupUsage

if TYPE_CHECKING:
    from localserve.engine.events import EventLog
    from localserve.engine.multimodal import EmbeddingCache
    from localserve.engine.scheduler import Scheduler
    from localserve.engine.sequence import Request
    from localserve.kv.block_manager import BlockManager


class StepTiming(Protocol):
    duration_s: float
    num_tokens: int


class EngineState(Protocol):
    """What a snapshot reads of the engine (`LLMEngine` has it; this module does not import the engine,
    which imports it)."""

    scheduler: Scheduler
    block_manager: BlockManager
    events: EventLog
    step_history: Sequence[StepTiming]
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_requests_finished: int
    num_requests_failed: int


def run_length_encode(states: str) -> str:
    """'uuus..' -> 'u3s.2': each state character followed by its run length when that is above 1."""
    return "".join(char + (str(count) if count > 1 else "")
                   for char, count in ((c, sum(1 for _ in run)) for c, run in itertools.groupby(states)))


@dataclass(frozen=True)
class Gauges:
    """Values now."""

    num_requests_running: int
    num_requests_waiting: int  # not admitted yet, or preempted by recompute
    num_requests_swapped: int
    kv_cache_usage_ratio: float  # used GPU blocks / all GPU blocks (0-1)
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_free_cpu_blocks: int
    last_step_s: float
    last_step_tokens: int
    # Speculative decoding since the engine started (0 without it): accepted over drafted tokens, and the
    # tokens a verification yields on average (the accepted ones and the target's own).
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    step_limit_s: float = 0.0  # the time budget (--max-step-ms) of the last step that had one; 0: none yet
    # With layer groups (kv/layer_groups.py), each group's pool, group 0 first (the block counts above are their
    # sums); empty: one pool.
    kv_groups: tuple[GroupUsage, ...] = ()


@dataclass(frozen=True)
class Counters:
    """Totals since the engine started; they only grow."""

    num_steps: int
    num_preemptions: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swap_fallbacks: int  # swap asked for, swap pool full: preempted by recompute instead
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    cow_copies: int
    cached_block_evictions: int
    num_requests_finished: int
    num_requests_failed: int
    spec_num_drafts: int = 0  # verify rows
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Images (engine/multimodal.py): embeddings made (the encoder run), found in the embeddings cache, and the
    # seconds the encoder took.
    num_images_encoded: int = 0
    num_image_cache_hits: int = 0
    image_encode_s: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    gauges: Gauges
    counters: Counters


@dataclass(frozen=True)
class RequestSnapshot:
    label: str
    state: str  # waiting | prefill | decode | preempted | swapped
    num_prompt_tokens: int
    num_computed_prompt_tokens: int
    num_output_tokens: int
    num_seqs: int
    num_preemptions: int
    num_cached_tokens: int
    tokens_per_s: float
    block_tables: list[list[int]]  # each live sequence's GPU blocks while it runs, else none
    cpu_block_tables: list[list[int]]  # each live sequence's swap-pool blocks while it is swapped out, else none
    constrained: bool  # the request has a grammar (SamplingParams.grammar)
    num_reasoning_seqs: int  # live sequences inside their reasoning block (SamplingParams.reasoning_end)
    spec_acceptance_rate: float = 0.0  # its sequences' accepted over drafted tokens (0: no draft yet)
    spec_mean_accepted_length: float = 0.0  # tokens per verification (0: none yet)
    image_spans: tuple[tuple[int, int], ...] = ()  # (offset, length) of each image's tokens in its prompt


@dataclass(frozen=True)
class EngineSnapshot:
    time: float
    blocks: str  # run-length encoded GPU block states: . free, c cached, u used, s shared
    cpu_blocks: str  # run-length encoded swap pool: . free, w holding a swapped-out block
    requests: list[RequestSnapshot]  # oldest first
    stats: EngineStats
    last_event_seq: int  # the newest event the snapshot reflects

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "num_steps": self.stats.counters.num_steps, "blocks": self.blocks,
                "cpu_blocks": self.cpu_blocks, "requests": [asdict(r) for r in self.requests],
                "gauges": asdict(self.stats.gauges), "counters": asdict(self.stats.counters)}


def read_stats(engine: EngineState) -> EngineStats:
    scheduler = engine.scheduler
    queues, preemption, bm = scheduler.queues, scheduler.preemption, engine.block_manager
    last = engine.step_history[-1] if engine.step_history else None
    spec = scheduler.speculation.totals if scheduler.speculation is not None else SpecTotals()
    gauges = Gauges(len(queues.running), len(queues.waiting), len(queues.swapped), bm.usage_ratio,
                    bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks, bm.num_free_cpu_blocks,
                    last.duration_s if last else 0.0, last.num_tokens if last else 0, spec.acceptance_rate,
                    spec.mean_accepted_length,
                    scheduler.step_budget.last_limit_s if scheduler.step_budget is not None else 0.0,
                    tuple(bm.group_usage()) if bm.num_groups > 1 else ())
    by_mode = preemption.num_preemptions_by_mode
    counters = Counters(engine.num_steps, preemption.num_preemptions, by_mode["recompute"], by_mode["swap"],
                        preemption.num_swap_fallbacks, bm.prefix_query_tokens, bm.prefix_hit_tokens,
                        engine.num_prompt_tokens, engine.num_generation_tokens, bm.cow_copies,
                        bm.cached_block_evictions, engine.num_requests_finished, engine.num_requests_failed,
                        spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                        *_image_counters(getattr(engine, "image_embeds", None)))
    return EngineStats(gauges, counters)


def _image_counters(cache: EmbeddingCache | None) -> tuple[int, int, float]:
    return (cache.num_encoded, cache.num_hits, cache.encode_s) if cache is not None else (0, 0, 0.0)


def _request_snapshot(engine: EngineState, request: Request, queue: str, now: float) -> RequestSnapshot:
    live = request.live_seqs
    prompt_len = len(request.prompt_token_ids)
    computed = max((min(seq.num_computed_tokens, prompt_len) for seq in live), default=0)
    if queue == "running":
        state = "decode" if all(seq.num_uncomputed_tokens <= 1 for seq in live) else "prefill"
    elif queue == "swapped":
        state = "swapped"
    else:
        state = "preempted" if request.num_preemptions else "waiting"
    num_output = max((len(seq.output_token_ids) for seq in request.seqs), default=0)
    elapsed = now - request.first_token_time if request.first_token_time is not None else 0.0
    # A request preempted by recompute holds no blocks (and has nothing computed); one swapped out holds CPU blocks.
    # Group 0's tables (the first blocks of the map); a window group's given-back entries are left out.
    tables = [[block_id for block_id in engine.block_manager.block_table(seq.seq_id) if block_id >= 0]
              for seq in live] if queue != "waiting" else []
    spec = spec_totals(seq.speculation for seq in request.seqs)
    return RequestSnapshot(request.label, state, prompt_len, computed, num_output, len(live),
                           request.num_preemptions, request.num_cached_tokens,
                           num_output / elapsed if elapsed > 0 else 0.0,
                           tables if queue == "running" else [], tables if queue == "swapped" else [],
                           request.params.grammar is not None, sum(seq.in_reasoning for seq in live),
                           spec.acceptance_rate, spec.mean_accepted_length,
                           tuple((span.offset, span.length) for span in request.multimodal.spans)
                           if request.multimodal is not None else ())


def read_snapshot(engine: EngineState) -> EngineSnapshot:
    """Every block, every request and the statistics, as of now (call on the engine thread)."""
    now = time.monotonic()
    queues = engine.scheduler.queues
    pool = engine.block_manager.snapshot()
    queued = sorted(((request, queue) for queue, requests in (("running", queues.running),
                                                              ("swapped", queues.swapped),
                                                              ("waiting", queues.waiting))
                     for request in requests), key=lambda entry: entry[0].arrival)
    requests = [_request_snapshot(engine, request, queue, now) for request, queue in queued]
    cpu_states = pool.cpu_block_states.replace("u", "w").replace("s", "w")
    return EngineSnapshot(time.time(), run_length_encode(pool.block_states), run_length_encode(cpu_states),
                          requests, read_stats(engine), engine.events.last_seq)
