"""Turns a scheduled batch into tensors and runs the model: the one place Python lists become tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from localserve.attention import AttentionMetadata, TorchAttentionBackend
from localserve.kv_cache import PagedKVCache
from localserve.models import ForwardContext, LlamaForCausalLM


@dataclass
class SeqChunk:
    """One sequence's part of a step: `token_ids` are new tokens at positions start_pos, start_pos + 1, ..."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    needs_logits: bool = True  # False for a prefill chunk that does not reach the prompt's end

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class StepInput:
    """Everything the model runner needs for one forward pass."""

    chunks: list[SeqChunk]
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (source, destination)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, gpu_block)


class ModelRunner:
    """Owns the model, the KV pool and the attention backend; executes one step at a time."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, backend=None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend or TorchAttentionBackend()
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run one step; returns logits [num chunks with needs_logits, vocab] in their order.

        Block moves come first, in this order: swap-out, swap-in, copy-on-write; the forward pass then
        writes into blocks those moves may just have freed or filled.
        """
        self.kv_cache.swap_out(step.swap_out)
        self.kv_cache.swap_in(step.swap_in)
        self.kv_cache.copy_blocks(step.block_copies)
        if not step.chunks:
            return torch.empty(0)
        block_size = self.kv_cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for chunk in step.chunks:
            for pos in range(chunk.start_pos, chunk.context_len):
                slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
            positions.extend(range(chunk.start_pos, chunk.context_len))
            input_ids.extend(chunk.token_ids)
            if chunk.needs_logits:
                logit_rows.append(len(input_ids) - 1)
        width = max(len(chunk.block_table) for chunk in step.chunks)
        tables = [chunk.block_table + [0] * (width - len(chunk.block_table)) for chunk in step.chunks]
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
            query_lens=[len(chunk.token_ids) for chunk in step.chunks],
            context_lens=[chunk.context_len for chunk in step.chunks],
        )
        ctx = ForwardContext(self.backend, self.kv_cache, metadata)
        hidden = self.model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), ctx)
        return self.model.compute_logits(hidden[torch.tensor(logit_rows, dtype=torch.int64, device=device)])

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits at every position of one prompt run as a single chunk: [len(token_ids), vocab]."""
        block_size = self.kv_cache.block_size
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor([block_table[p // block_size] * block_size + p % block_size
                                       for p in range(len(token_ids))], device=self.device),
            block_tables=torch.tensor([block_table], device=self.device),
            query_lens=[len(token_ids)], context_lens=[len(token_ids)])
        ctx = ForwardContext(self.backend, self.kv_cache, metadata)
        hidden = self.model(torch.tensor(token_ids, device=self.device),
                            torch.arange(len(token_ids), device=self.device), ctx)
        return self.model.compute_logits(hidden)
