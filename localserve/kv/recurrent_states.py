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
    """One layer's states of the step's held sequences, made again from the states they read (module doc)."""

    def __call__(self, members: list[int], conv: torch.Tensor, matrix: torch.Tensor,
                 tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """For the held sequences `members` (places in the layer's `hold` list), from the conv inputs
        [M, conv_dim, conv_width - 1] and matrices [M, heads, key_dim, value_dim] they read: the states after
        each of `tokens[i]` (increasing counts of member i's tokens of the step), member after member: conv
        [N, conv_dim, conv_width - 1] and matrices [N, heads, key_dim, value_dim]."""


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
    replays: dict[int, tuple[list[int], Replay]] = field(default_factory=dict)  # layer -> (sequences, replay)

    def initial(self, layer: int, seqs: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's starting state (of `seqs`, indices into the step, where given): conv inputs
        [S, conv_dim, conv_width - 1] and matrices [S, heads, key_dim, value_dim], zeros where its read slot
        is -1 (fresh copies, safe to update)."""
        reads = self.read_slots if seqs is None else self.read_slots[seqs]
        fresh = (reads < 0).view(-1, 1, 1)
        slots = reads.clamp(min=0)
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

    def hold(self, layer: int, seqs: list[int], replay: Replay) -> None:
        """A layer's states of the held sequences `seqs` (indices into the step), made by `replay` once
        `settle` knows which tokens stay."""
        if not set(seqs) <= self.held:
            raise ValueError(f"layer {layer}: sequences {sorted(set(seqs) - self.held)} of the step are not held; "
                             "their states are saved at once")
        self.replays[layer] = (list(seqs), replay)

    def settle(self, kept: Mapping[int, int]) -> None:
        """Write the states of the held sequences: of sequence i (an index into the step), those of its first
        `kept[i]` tokens (`kept_state_slots`); a held sequence not in `kept` writes nothing (it has ended).
        Every layer must have handed over its replay (`hold`)."""
        for layer, (seqs, replay) in self.replays.items():
            members = [member for member, seq in enumerate(seqs) if seq in kept]
            if not members:
                continue
            chosen = [seqs[member] for member in members]
            conv, matrix = self.initial(layer, chosen)  # the held rows wrote nothing: their reads are as read
            writes = [kept_state_slots(self.saves[seq], kept[seq]) for seq in chosen]
            conv_after, matrix_after = replay(members, conv, matrix, [[tokens for tokens, _ in seq] for seq in writes])
            slots = torch.tensor([slot for seq in writes for _, slot in seq], dtype=torch.int64,
                                 device=self.read_slots.device)
            self.save(layer, slots, conv_after, matrix_after)
        self.replays.clear()
