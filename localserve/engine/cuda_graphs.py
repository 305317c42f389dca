"""Decode steps as captured CUDA graphs, for the Triton attention backend on CUDA.

A decode-only step (every sequence brings one new token) of up to MAX_GRAPH_BATCH sequences replays the
graph captured for the smallest size in GRAPH_BATCH_SIZES that holds it; a size is captured the first
time it is needed. All of a step's inputs (token ids, positions, slots, context lengths, block tables and
the attention plan) are written into one pinned host buffer and reach the graph's static device buffer
in one host-to-device copy. Padding rows get slot -1 and padding tiles, so the kernels skip them. Mixed
steps, and decode steps whose block tables are wider than the graphs', run eagerly.

Without `capture` (a CPU, for tests) the same static buffers feed an eager forward pass, so everything
but the capture itself is exercised without a GPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from localserve.attention.base import AttentionInputs
from localserve.attention.triton_backend import TritonAttentionBackend, TritonAttentionMetadata
from localserve.engine.step import StepInput
from localserve.kernels.attention_plan import BLOCK_N, DECODE_BLOCK_M, AttentionPlan, choose_num_splits
from localserve.kv.cache import PagedKVCache
from localserve.models.protocol import CausalLM, ForwardContext

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
MAX_GRAPH_BATCH = GRAPH_BATCH_SIZES[-1]
# The int32 fields at the head of the packed inputs, in order, one entry per row (query_start: one more);
# the block tables follow at a fixed offset.
FIELDS = ("input_ids", "positions", "slots", "seq_lens", "query_start", "tile_seq", "tile_start")


@dataclass
class _Graph:
    """One captured batch size: its replayable graph (None when not capturing) and its output."""

    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor  # [size, vocab], refreshed by each replay


class DecodeGraphs:
    """Runs decode-only steps from static buffers, captured as one CUDA graph per batch size."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, backend: TritonAttentionBackend,
                 max_model_len: int, capture: bool = True) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.capture = capture
        self.device = next(model.parameters()).device
        self.block_size = kv_cache.block_size
        self.max_model_len = max_model_len
        # A table row covers the longest sequence, which can never hold more blocks than the pool has.
        self.table_width = min(-(-max_model_len // self.block_size), kv_cache.num_blocks)
        lengths = self._field_lengths(MAX_GRAPH_BATCH)
        self.header = sum(lengths.values())
        size = self.header + MAX_GRAPH_BATCH * self.table_width
        self.staging = torch.zeros(size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.static = torch.zeros(size, dtype=torch.int32, device=self.device)
        self.graphs: dict[int, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.copied = torch.cuda.Event() if self.device.type == "cuda" else None  # the last copy is done
        if any(codec.needs_positions for codec in kv_cache.key_codecs):
            # A captured graph holds the rotary table's address: make it cover every position now.
            backend.rotary_table(kv_cache, max_model_len, self.device)

    @staticmethod
    def _field_lengths(size: int) -> dict[str, int]:
        return {name: size + (name == "query_start") for name in FIELDS}

    def can_run(self, step: StepInput) -> bool:
        """Whether `step` is a decode-only step that fits the graphs."""
        chunks = step.chunks
        return (0 < len(chunks) <= MAX_GRAPH_BATCH
                and all(len(c.token_ids) == 1 and c.needs_logits and len(c.block_table) <= self.table_width
                        for c in chunks))

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """Logits [num sequences, vocab] of a decode-only step (see can_run)."""
        num_seqs = len(step.chunks)
        size = GRAPH_BATCH_SIZES[bisect.bisect_left(GRAPH_BATCH_SIZES, num_seqs)]
        self._stage(step, size)
        used = self.header + size * self.table_width
        self.static[:used].copy_(self.staging[:used], non_blocking=True)  # the step's one host-to-device copy
        if self.copied is not None:
            self.copied.record()
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        entry = self.graphs[size]
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.logits = self._forward(size)
        return entry.logits[:num_seqs]

    def _stage(self, step: StepInput, size: int) -> None:
        """Write the step's inputs into the staging buffer, padded to `size` rows (numpy, no per-row loop)."""
        chunks = step.chunks
        num_seqs = len(chunks)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy may still be reading the staging buffer
        staging = self.staging.numpy()
        views = self._views(staging, size)
        positions = np.fromiter((c.start_pos for c in chunks), np.int64, num_seqs)
        table_lens = np.fromiter((len(c.block_table) for c in chunks), np.int64, num_seqs)
        flat_tables = np.fromiter((b for c in chunks for b in c.block_table), np.int64, int(table_lens.sum()))
        tables = views["block_tables"]
        tables[:] = 0
        rows = np.repeat(np.arange(num_seqs), table_lens)
        columns = np.arange(flat_tables.size) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)
        tables[rows, columns] = flat_tables
        views["input_ids"][:num_seqs] = np.fromiter((c.token_ids[0] for c in chunks), np.int64, num_seqs)
        views["positions"][:num_seqs] = positions
        views["slots"][:num_seqs] = (tables[np.arange(num_seqs), positions // self.block_size] * self.block_size
                                     + positions % self.block_size)
        views["seq_lens"][:num_seqs] = positions + 1
        for name in ("input_ids", "positions", "seq_lens", "tile_start"):
            views[name][num_seqs:] = 0
        views["slots"][num_seqs:] = -1  # padding rows write nowhere...
        views["tile_seq"][:] = np.where(np.arange(size) < num_seqs, np.arange(size), -1)  # ...and attend nowhere
        views["tile_start"][:num_seqs] = 0
        views["query_start"][:] = np.minimum(np.arange(size + 1), num_seqs)

    def _views(self, buffer, size: int) -> dict:
        """The fields of a packed buffer (numpy array or tensor) laid out for `size` rows."""
        views, offset = {}, 0
        for name, length in self._field_lengths(size).items():
            views[name] = buffer[offset:offset + length]
            offset += length
        views["block_tables"] = buffer[self.header:self.header + size * self.table_width].reshape(
            size, self.table_width)
        return views

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the static buffers of `size` rows: what a graph of that size captures."""
        views = self._views(self.static, size)
        kv_heads = self.kv_cache.key_codecs[0].num_kv_heads
        num_heads = self.model.config.num_heads
        group = num_heads // kv_heads
        num_splits = self.backend.num_splits or choose_num_splits(size * kv_heads, self.max_model_len,
                                                                  self._num_sms())
        plan = AttentionPlan(views["query_start"], views["seq_lens"], views["block_tables"], views["tile_seq"],
                             views["tile_start"], max(DECODE_BLOCK_M, 1 << (group - 1).bit_length()),
                             BLOCK_N, num_splits, self.max_model_len)
        # The lengths are only known on the device; the backend reads these lists for nothing but the
        # rotary table's length, which the constructor already made cover max_model_len.
        inputs = AttentionInputs(views["slots"], views["positions"], views["block_tables"], [1] * size,
                                 [self.max_model_len] * size, self.block_size)
        ctx = ForwardContext(self.backend, self.kv_cache, TritonAttentionMetadata(inputs, plan))
        hidden = self.model(views["input_ids"], views["positions"], ctx)
        return self.model.compute_logits(hidden)

    def _num_sms(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def _capture(self, size: int) -> _Graph:
        if not self.capture:
            return _Graph(None, self._forward(size))
        # Warm up on a side stream (Triton compiles, caches fill), then record the same work.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(size)
        return _Graph(graph, logits)
