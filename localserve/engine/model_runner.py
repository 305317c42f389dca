"""Turns a step contract into tensors and runs the model: the one place Python lists become tensors."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, chain
from operator import attrgetter

import numpy as np
import torch

from localserve.attention.base import AttentionBackend, AttentionInputs, GroupTables
from localserve.engine.block_tables import BlockTableRows
from localserve.engine.config import IMAGE_CACHE_BYTES
from localserve.engine.mrope import step_rope_positions
from localserve.engine.multimodal import EmbeddingCache, chunk_spans, gather_input_embeds, key_limits
from localserve.engine.step import SeqChunk, StepInput
from localserve.kv.cache import PagedKVCache
from localserve.kv.recurrent_states import StepStates
from localserve.kv.state_steps import step_state_slots
from localserve.models.protocol import CausalLM, ForwardContext, InputEmbeds

_start_pos, _seq_id, _block_table, _token_ids, _needs_logits, _multimodal = map(
    attrgetter, ("start_pos", "seq_id", "block_table", "token_ids", "needs_logits", "multimodal"))


class ModelRunner:
    """Owns the model, the KV pool and the attention backend; executes one step at a time.

    On CUDA with the Triton backend, decode-only steps replay captured CUDA graphs (engine/cuda_graphs.py)
    when `max_model_len` is given and the model allows it (`supports_cuda_graphs`); other steps run eagerly.

    With a state group (a model with recurrent layers, `kv_cache.states`), every forward pass gets the
    step's `StepStates`, built from each chunk's state-group table by `step_state_slots`; that group has no
    K/V, so the attention inputs carry only the other groups' tables, and decodes run eagerly. A speculative
    verify row's states are written only after its verification (`settle_states`), for its kept tokens.

    Chunks with images (`SeqChunk.multimodal`) hand the model their image tokens' embeddings
    (engine/multimodal.py), made once per image while `image_embeds` (an `EmbeddingCache` of
    `image_cache_bytes`) keeps them; such a step runs eagerly, and the tokens of a bidirectional span see the
    whole span (`AttentionInputs.key_limits`). A request whose images carry mRoPE offsets
    (Qwen3.5, `MultiModalInputs.mrope`) gets the model's rotary positions from its map (engine/mrope.py) in every
    step, decodes included (eager too); the attention inputs keep the cache's own positions.
    """

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, backend: AttentionBackend,
                 max_model_len: int | None = None, image_cache_bytes: int = IMAGE_CACHE_BYTES) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = next(model.parameters()).device
        self.state_group = kv_cache.state_group  # always the last group (PagedKVCache checks it)
        # The groups whose layers keep K and V: every group but the state group.
        self.num_groups = len(kv_cache.group_num_blocks) - (self.state_group is not None)
        self.block_tables = [BlockTableRows() for _ in range(self.num_groups)]  # a mirror per K/V group
        self.decode_graphs = None
        # The last step's verify rows, whose recurrent states wait for `settle_states`: (states, seq id -> row).
        self.held_states: tuple[StepStates, dict[int, int]] | None = None
        self.image_embeds = EmbeddingCache(image_cache_bytes)
        # The dtype image embeddings are handed over in: the model's (its first floating-point weights').
        self.embeds_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        # The captured graphs carry one group's tables and no states: a pool with layer groups decodes eagerly.
        if (self.device.type == "cuda" and backend.name == "triton" and max_model_len and model.supports_cuda_graphs
                and len(kv_cache.group_num_blocks) == 1):
            from localserve.engine.cuda_graphs import DecodeGraphs  # imports triton: only where it runs

            self.decode_graphs = DecodeGraphs(model, kv_cache, backend, max_model_len)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run one step; returns logits [num logits rows, vocab]: a row per chunk with needs_logits, in their
        order, and for a verify row one per drafted token besides (StepInput).

        Block moves come first, in this order: swap-out, swap-in, copy-on-write; the forward pass then
        writes into blocks those moves may just have freed or filled.
        """
        self.kv_cache.swap_out(step.swap_out)
        self.kv_cache.swap_in(step.swap_in)
        self.kv_cache.copy_blocks(step.block_copies)
        if not step.chunks:
            return torch.empty(0)
        input_embeds = self.input_embeds(step)
        rope_positions = self.rope_positions(step)
        if (input_embeds is None and rope_positions is None and self.decode_graphs is not None
                and self.decode_graphs.can_run(step)):
            return self.decode_graphs.run(step)
        inputs, input_ids, logit_rows = self.prepare_inputs(step)
        return self._forward(input_ids, inputs, logit_rows, self.step_states(step), input_embeds, rope_positions)

    @torch.inference_mode()
    def execute_pooled(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a step holding embedding chunks (`needs_hidden`): `execute`'s logits, and the final hidden
        states [tokens of those chunks, hidden_size] of their tokens, chunk after chunk. Always eager."""
        if not any(chunk.needs_hidden for chunk in step.chunks):
            raise ValueError("execute_pooled: the step holds no embedding chunk")
        self.kv_cache.swap_out(step.swap_out)
        self.kv_cache.swap_in(step.swap_in)
        self.kv_cache.copy_blocks(step.block_copies)
        inputs, input_ids, logit_rows = self.prepare_inputs(step)
        ctx = ForwardContext(self.backend, self.kv_cache, self.backend.build_metadata(inputs), self.step_states(step),
                             self.input_embeds(step))
        rope_positions = self.rope_positions(step)
        hidden = self.model(input_ids, inputs.positions if rope_positions is None else rope_positions, ctx)
        ends = list(accumulate(len(chunk.token_ids) for chunk in step.chunks))
        pooled_rows = np.concatenate([np.arange(end - len(chunk.token_ids), end)
                                      for end, chunk in zip(ends, step.chunks) if chunk.needs_hidden])
        pooled = hidden[torch.from_numpy(pooled_rows).to(self.device)]
        logits = self.model.compute_logits(hidden[logit_rows]) if len(logit_rows) else torch.empty(0)
        return logits, pooled

    def prepare_inputs(self, step: StepInput) -> tuple[AttentionInputs, torch.Tensor, torch.Tensor | None]:
        """The step's attention inputs, its token ids [T] and the rows [num logits] whose logits are wanted
        (None: every token's, as in a step of decodes only).

        Python touches each sequence a few times; block tables are kept between steps (`BlockTableRows`),
        so only the block ids that changed are read; positions and slots are computed on whole arrays.
        """
        block_size = self.kv_cache.block_size
        chunks = step.chunks
        num_seqs = len(chunks)
        query_lens = [len(chunk.token_ids) for chunk in chunks]
        num_tokens = sum(query_lens)
        starts = np.fromiter(map(_start_pos, chunks), np.int64, num_seqs)
        seq_ids = list(map(_seq_id, chunks))
        group_block_tables = [self.block_tables[0].gather(seq_ids, list(map(_block_table, chunks)))]
        group_block_tables += [rows.gather(seq_ids, [chunk.group_block_tables[group] for chunk in chunks])
                               for group, rows in enumerate(self.block_tables[1:], start=1)]
        input_ids = np.fromiter(chain.from_iterable(map(_token_ids, chunks)), np.int64, num_tokens)
        if num_tokens == num_seqs:  # one token each, at its start position: decodes (and one-token chunks)
            seq_of_token, positions = np.arange(num_seqs), starts
            context_lens = starts + 1
            logit_rows = None if all(map(_needs_logits, chunks)) else [
                row for row, chunk in enumerate(chunks) if chunk.needs_logits]
        else:
            lens = np.array(query_lens, np.int64)
            seq_of_token = np.repeat(np.arange(num_seqs), lens)
            positions = starts[seq_of_token] + np.arange(num_tokens) - (np.cumsum(lens) - lens)[seq_of_token]
            context_lens = starts + lens
            logit_rows = [row for end, chunk in zip(accumulate(query_lens), chunks) if chunk.needs_logits
                          for row in range(end - 1 - chunk.num_draft_tokens, end)]
        device = self.device
        logical_blocks, offsets = positions // block_size, positions % block_size
        groups = [GroupTables(torch.from_numpy(tables[seq_of_token, logical_blocks] * block_size + offsets).to(device),
                              torch.from_numpy(tables).to(device)) for tables in group_block_tables]
        inputs = AttentionInputs(
            slot_mapping=groups[0].slot_mapping, positions=torch.from_numpy(positions).to(device),
            block_tables=groups[0].block_tables, query_lens=query_lens, context_lens=context_lens.tolist(),
            block_size=block_size, groups=groups if self.num_groups > 1 else [],
            layer_groups=list(self.kv_cache.layer_groups) if self.num_groups > 1 else [])
        if num_tokens > num_seqs and any(map(_multimodal, chunks)):  # images in a chunk of several tokens
            limits = key_limits(chunks, positions)
            if limits is not None:
                inputs.key_limits = torch.from_numpy(limits).to(device)
        return (inputs, torch.from_numpy(input_ids).to(device),
                None if logit_rows is None else torch.tensor(logit_rows, dtype=torch.int64, device=device))

    def input_embeds(self, step: StepInput) -> InputEmbeds | None:
        """The step's image-token rows and their embeddings (engine/multimodal.py); None: text only."""
        if not any(map(_multimodal, step.chunks)):  # the common case, checked at C speed
            return None
        return gather_input_embeds(step.chunks, self.image_embeds, self.model.config.hidden_size, self.device,
                                   self.embeds_dtype)

    def rope_positions(self, step: StepInput) -> torch.Tensor | None:
        """The positions the model's rotary embedding takes where they are not the cache's: a step with a
        request whose images carry mRoPE offsets ([T] shifted, or [3, T]: engine/mrope.py); else None."""
        if not any(map(_multimodal, step.chunks)):  # the common case, checked at C speed
            return None
        positions = step_rope_positions(step.chunks)
        return None if positions is None else torch.from_numpy(positions).to(self.device)

    def encode_images(self, chunk: SeqChunk) -> None:
        """Make (or find in `image_embeds`) the embeddings of every image the chunk's tokens overlap; raises
        (a ValueError naming the span for embeddings of the wrong shape) what their source raises."""
        for index, _, _, _ in chunk_spans(chunk):
            self.image_embeds.get(chunk.multimodal, index, self.model.config.hidden_size, self.device,
                                  self.embeds_dtype)

    def step_states(self, step: StepInput) -> StepStates | None:
        """The step's recurrent-state reads and writes, chunk after chunk (None without a state group): each
        chunk's from its state-group table, its computed tokens (`start_pos`) and its new ones. A verify row
        (drafted tokens) is held: its states are written by `settle_states` once its verification is done."""
        if self.state_group is None:
            return None
        block_size, group = self.kv_cache.block_size, self.state_group
        read_slots, saves, held = [], [], []
        for index, chunk in enumerate(step.chunks):
            read, writes = step_state_slots(chunk.group_block_tables[group], chunk.start_pos, len(chunk.token_ids),
                                            block_size)
            read_slots.append(read)
            saves.append(writes)
            if chunk.num_draft_tokens:
                held.append(index)
        states = StepStates(self.kv_cache.states, torch.tensor(read_slots, dtype=torch.int64, device=self.device),
                            saves, frozenset(held))
        self.held_states = (states, {step.chunks[index].seq_id: index for index in held}) if held else None
        return states

    @torch.inference_mode()
    def settle_states(self, kept: dict[int, int]) -> None:
        """After the last step's verification: write the recurrent states of its verify rows' kept tokens
        (`kept`: sequence id -> the row's tokens that stay, its last real token and the accepted drafted
        ones), so no rejected token reaches a state. A sequence left out (it ended) writes nothing. Nothing to
        do for a model without recurrent layers or a step without verify rows."""
        if self.held_states is None:
            return
        states, index_of = self.held_states
        self.held_states = None
        states.settle({index_of[seq_id]: num_kept for seq_id, num_kept in kept.items() if seq_id in index_of})

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], block_table: list[int],
                      group_block_tables: Sequence[list[int]] = ()) -> torch.Tensor:
        """Logits at every position of one prompt run as a single chunk from position 0: [len(token_ids), vocab].

        `group_block_tables`: the prompt's table in each layer group (SeqChunk's field; group 0's is
        `block_table`); empty: every layer reads group 0's table. A model with recurrent layers needs them: its
        state group's table must have a slot at the prompt's last entry (the running state), distinct from
        any checkpoint slot it has before (NO_BLOCK elsewhere keeps just the running state)."""
        if not group_block_tables and self.state_group is None:
            inputs = AttentionInputs.for_prompt(len(token_ids), block_table, self.kv_cache.block_size, self.device)
            return self._forward(torch.tensor(token_ids, device=self.device), inputs, None)
        if len(group_block_tables) != len(self.kv_cache.group_num_blocks):
            raise ValueError(f"prompt_logits: a pool of {len(self.kv_cache.group_num_blocks)} layer groups needs a "
                             f"table per group, got {len(group_block_tables)}")
        step = StepInput([SeqChunk(list(token_ids), 0, block_table, group_block_tables=group_block_tables)])
        inputs, input_ids, _ = self.prepare_inputs(step)
        return self._forward(input_ids, inputs, None, self.step_states(step))

    def _forward(self, input_ids: torch.Tensor, inputs: AttentionInputs, logit_rows: torch.Tensor | None,
                 states: StepStates | None = None, input_embeds: InputEmbeds | None = None,
                 rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        ctx = ForwardContext(self.backend, self.kv_cache, self.backend.build_metadata(inputs), states, input_embeds)
        hidden = self.model(input_ids, inputs.positions if rope_positions is None else rope_positions, ctx)
        return self.model.compute_logits(hidden if logit_rows is None else hidden[logit_rows])
