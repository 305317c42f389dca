"""The tensors behind a state group's slots (kv/state_shape.py), and the step's view a recurrent layer reads.

`RecurrentStateCache` holds, per recurrent layer, its convolution inputs [slots, conv_dim, conv_width - 1]
(in the model's dtype) and its delta-rule matrices [slots, heads, key_dim, value_dim] (in `state_dtype`,
float32 by default, as transformers keeps them), with a CPU copy of the same layout for swapped-out
sequences. Block moves of the state group copy whole slots.

`StepStates` is what one forward pass hands a recurrent layer (ForwardContext.states): for each sequence
of the step, in the batch's order, the slot its state is read from (-1: it starts from zeros) and the
slots to write, each after a number of the step's tokens of that sequence (a checkpoint inside the chunk,
and always, last, the running state after all of them).

A speculative verify row's sequence is `held`: the layers compute its outputs over the whole row but write
none of its states, since the drafted tokens may be rejected; each layer hands over instead a `Replay` (its
states after given numbers of the row's tokens, from the state the row read), and once the verification
has decided how many of the row's tokens stay, `settle` writes their states (kv/state_steps.py,
`kept_state_slots`): a rejected token never reaches a slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from localserve.kv.block_pool import BlockMove
from localserve.kv.state_shape import StateShape
from localserve.kv.state_steps import kept_state_slots


class RecurrentStateCache:
    """Per recurrent layer: conv inputs and delta-rule matrices for `num_slots` slots (module doc)."""

    def __init__(self, layers: Sequence[int], shape: StateShape, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", state_dtype: torch.dtype = torch.float32,
                 num_cpu_slots: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"need num_slots >= 1, got {num_slots}")
        self.layers = tuple(layers)
        self.shape = shape
        self.num_slots = num_slots
        self.dtype, self.state_dtype = dtype, state_dtype
        pin = torch.device(device).type == "cuda"
        conv = (shape.conv_dim, shape.conv_width - 1)
        matrix = (shape.num_heads, shape.key_dim, shape.value_dim)
        self.conv = {layer: torch.zeros((num_slots, *conv), dtype=dtype, device=device) for layer in self.layers}
        self.matrix = {layer: torch.zeros((num_slots, *matrix), dtype=state_dtype, device=device)
                       for layer in self.layers}
        self.cpu_conv = {layer: torch.zeros((num_cpu_slots, *conv), dtype=dtype, pin_memory=pin)
                         for layer in self.layers}
        self.cpu_matrix = {layer: torch.zeros((num_cpu_slots, *matrix), dtype=state_dtype, pin_memory=pin)
                           for layer in self.layers}

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot over all the cache's layers."""
        return len(self.layers) * self.shape.nbytes(self.dtype.itemsize, self.state_dtype.itemsize)

    def copy_slots(self, moves: Sequence[BlockMove]) -> None:
        """Copy slot `source` to slot `destination` for each (source, destination, group) move."""
        if not moves:
            return
        device = next(iter(self.conv.values())).device
        src = torch.tensor([m[0] for m in moves], dtype=torch.int64, device=device)
        dst = torch.tensor([m[1] for m in moves], dtype=torch.int64, device=device)
        for layer in self.layers:
            self.conv[layer][dst] = self.conv[layer][src]
            self.matrix[layer][dst] = self.matrix[layer][src]

    def swap_out(self, moves: Sequence[BlockMove]) -> None:
        """Copy GPU slot -> CPU slot for each (gpu, cpu, group) move."""
        for gpu, cpu, _ in moves:
            for layer in self.layers:
                self.cpu_conv[layer][cpu].copy_(self.conv[layer][gpu], non_blocking=True)
                self.cpu_matrix[layer][cpu].copy_(self.matrix[layer][gpu], non_blocking=True)

    def swap_in(self, moves: Sequence[BlockMove]) -> None:
        """Copy CPU slot -> GPU slot for each (cpu, gpu, group) move."""
        for cpu, gpu, _ in moves:
            for layer in self.layers:
                self.conv[layer][gpu].copy_(self.cpu_conv[layer][cpu], non_blocking=True)
                self.matrix[layer][gpu].copy_(self.cpu_matrix[layer][cpu], non_blocking=True)


class Replay(Protocol):
    """A held sequence's states in one layer, made again from the state its step read (module doc)."""

    def __call__(self, conv: torch.Tensor, matrix: torch.Tensor,
                 tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """From the step's starting conv inputs [conv_dim, conv_width - 1] and matrices [heads, key_dim,
        value_dim]: the states after each of `tokens` (increasing counts of the step's tokens of the
        sequence), conv [N, conv_dim, conv_width - 1] and matrices [N, heads, key_dim, value_dim]."""


@dataclass
class StepStates:
    """One step's recurrent-state reads and writes (module doc), built by the model runner.

    `read_slots` [S] int64 on the cache's device (-1: start from zeros); `saves[i]`: sequence i's writes,
    (tokens of its query after which, slot), strictly increasing, the last at its whole query. `held`: the
    sequences (indices) whose writes wait for `settle` (verify rows); a layer writes only the others'.
    """

    cache: RecurrentStateCache
    read_slots: torch.Tensor
    saves: list[list[tuple[int, int]]]
    held: frozenset[int] = frozenset()
    replays: dict[int, list[tuple[int, Replay]]] = field(default_factory=dict)  # layer -> (sequence, replay)

    def initial(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's starting state: conv inputs [S, conv_dim, conv_width - 1] and matrices
        [S, heads, key_dim, value_dim], zeros where its read slot is -1 (fresh copies, safe to update)."""
        fresh = (self.read_slots < 0).view(-1, 1, 1)
        slots = self.read_slots.clamp(min=0)
        conv = self.cache.conv[layer][slots].masked_fill(fresh, 0)
        matrix = self.cache.matrix[layer][slots].masked_fill(fresh.unsqueeze(-1), 0)
        return conv, matrix

    def initial_conv(self, layer: int) -> torch.Tensor:
        """`initial`'s conv inputs alone, for a step that updates the matrices in the pool itself (a decode
        through `recurrent_gated_delta_rule_slots`)."""
        fresh = (self.read_slots < 0).view(-1, 1, 1)
        return self.cache.conv[layer][self.read_slots.clamp(min=0)].masked_fill(fresh, 0)

    def save_conv(self, layer: int, slots: torch.Tensor, conv: torch.Tensor) -> None:
        """`save`'s conv inputs alone."""
        self.cache.conv[layer].index_copy_(0, slots, conv.to(self.cache.dtype))

    def save(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, matrix: torch.Tensor) -> None:
        """Write states into `slots` [N]: conv [N, conv_dim, conv_width - 1], matrices [N, heads, key_dim,
        value_dim] (cast to the cache's dtypes)."""
        self.cache.conv[layer].index_copy_(0, slots, conv.to(self.cache.dtype))
        self.cache.matrix[layer].index_copy_(0, slots, matrix.to(self.cache.state_dtype))

    def save_slots(self) -> torch.Tensor:
        """Every slot of `saves` but the held sequences', sequence after sequence, in order: the `slots`
        argument of `save` for states computed in that order."""
        return torch.tensor([slot for index, seq in enumerate(self.saves) if index not in self.held
                             for _, slot in seq], dtype=torch.int64, device=self.read_slots.device)

    def hold(self, layer: int, seq: int, replay: Replay) -> None:
        """A layer's states of held sequence `seq`, made by `replay` once `settle` knows which tokens stay."""
        if seq not in self.held:
            raise ValueError(f"layer {layer}: sequence {seq} of the step is not held; its states are saved at once")
        self.replays.setdefault(layer, []).append((seq, replay))

    def settle(self, kept: Mapping[int, int]) -> None:
        """Write the states of the held sequences: of sequence i (an index into the step), those of its first
        `kept[i]` tokens (`kept_state_slots`); a held sequence not in `kept` writes nothing (it has ended).
        Every layer must have handed over its replays (`hold`)."""
        for layer, entries in self.replays.items():
            entries = [(seq, replay) for seq, replay in entries if seq in kept]
            if not entries:
                continue
            reads = self.read_slots[[seq for seq, _ in entries]]
            fresh = (reads < 0).view(-1, 1, 1)
            convs = self.cache.conv[layer][reads.clamp(min=0)].masked_fill(fresh, 0)
            matrices = self.cache.matrix[layer][reads.clamp(min=0)].masked_fill(fresh.unsqueeze(-1), 0)
            slots, saved_conv, saved_matrix = [], [], []
            for (seq, replay), conv, matrix in zip(entries, convs, matrices, strict=True):
                writes = kept_state_slots(self.saves[seq], kept[seq])
                conv_after, matrix_after = replay(conv, matrix, [tokens for tokens, _ in writes])
                slots += [slot for _, slot in writes]
                saved_conv.append(conv_after)
                saved_matrix.append(matrix_after)
            self.save(layer, torch.tensor(slots, dtype=torch.int64, device=self.read_slots.device),
                      torch.cat(saved_conv), torch.cat(saved_matrix))
        self.replays.clear()
