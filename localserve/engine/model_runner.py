"""Turns a step contract into tensors and runs the model: the one place Python lists become tensors."""

from __future__ import annotations

import torch

from localserve.attention.base import AttentionBackend, AttentionInputs
from localserve.engine.step import StepInput
from localserve.kv.cache import PagedKVCache
from localserve.models.llama import ForwardContext, LlamaForCausalLM


class ModelRunner:
    """Owns the model, the KV pool and the attention backend; executes one step at a time.

    On CUDA with the Triton backend, decode-only steps replay captured CUDA graphs (engine/cuda_graphs.py)
    when `max_model_len` is given; other steps run eagerly.
    """

    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, backend: AttentionBackend,
                 max_model_len: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = next(model.parameters()).device
        self.decode_graphs = None
        if self.device.type == "cuda" and backend.name == "triton" and max_model_len:
            from localserve.engine.cuda_graphs import DecodeGraphs  # imports triton: only where it runs

            self.decode_graphs = DecodeGraphs(model, kv_cache, backend, max_model_len)

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
        if self.decode_graphs is not None and self.decode_graphs.can_run(step):
            return self.decode_graphs.run(step)
        inputs, input_ids, logit_rows = self.prepare_inputs(step)
        return self._forward(input_ids, inputs, logit_rows)

    def prepare_inputs(self, step: StepInput) -> tuple[AttentionInputs, torch.Tensor, torch.Tensor]:
        """The step's attention inputs, its token ids [T] and the rows [num logits] whose logits are wanted."""
        block_size = self.kv_cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for chunk in step.chunks:
            table = chunk.block_table
            for pos in range(chunk.start_pos, chunk.context_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.extend(range(chunk.start_pos, chunk.context_len))
            input_ids.extend(chunk.token_ids)
            if chunk.needs_logits:
                logit_rows.append(len(input_ids) - 1)
        width = max(len(chunk.block_table) for chunk in step.chunks)
        tables = [chunk.block_table + [0] * (width - len(chunk.block_table)) for chunk in step.chunks]
        device = self.device
        inputs = AttentionInputs(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
            query_lens=[len(chunk.token_ids) for chunk in step.chunks],
            context_lens=[chunk.context_len for chunk in step.chunks],
            block_size=block_size)
        return (inputs, torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(logit_rows, dtype=torch.int64, device=device))

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits at every position of one prompt run as a single chunk: [len(token_ids), vocab]."""
        inputs = AttentionInputs.for_prompt(len(token_ids), block_table, self.kv_cache.block_size, self.device)
        return self._forward(torch.tensor(token_ids, device=self.device), inputs, None)

    def _forward(self, input_ids: torch.Tensor, inputs: AttentionInputs,
                 logit_rows: torch.Tensor | None) -> torch.Tensor:
        ctx = ForwardContext(self.backend, self.kv_cache, self.backend.build_metadata(inputs))
        hidden = self.model(input_ids, inputs.positions, ctx)
        return self.model.compute_logits(hidden if logit_rows is None else hidden[logit_rows])
