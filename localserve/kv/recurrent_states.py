"""The tensors behind a state group's slots (kv/state_shape.py), and the step's view a recurrent layer reads.

`RecurrentStateCache` holds, per recurrent layer, its convolution inputs [slots, conv_dim, conv_width - 1]
(in the model's dtype) and its delta-rule matrices [slots, heads, key_dim, value_dim] (in `state_dtype`,
float32 by default, as transformers keeps them), with a CPU copy of the same layout for swapped-out
sequences. Block moves of the state group copy whole slots.

`StepStates` is what one forward pass hands a recurrent layer (ForwardContext.states): for each sequence
of the step, in the batch's order, the slot its state is read from (-1: it starts from zeros) and the
slots to write, each after a number of the step's tokens of that sequence (a checkpoint inside the chunk,
and always, last, the running state after all of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from localserve.kv.block_pool import BlockMove
from localserve.kv.state_shape import StateShape


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


@dataclass
class StepStates:
    """One step's recurrent-state reads and writes (module doc), built by the model runner.

    `read_slots` [S] int64 on the cache's device (-1: start from zeros); `saves[i]`: sequence i's writes,
    (tokens of its query after which, slot), strictly increasing, the last at its whole query.
    """

    cache: RecurrentStateCache
    read_slots: torch.Tensor
    saves: list[list[tuple[int, int]]]

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
        """Every slot of `saves`, sequence after sequence, in order: the `slots` argument of `save` for
        states computed in that order."""
        return torch.tensor([slot for seq in self.saves for _, slot in seq], dtype=torch.int64,
                            device=self.read_slots.device)
