"""The fixed-size state a recurrent (linear-attention) layer keeps per sequence instead of KV. No torch here.

A Gated DeltaNet layer (Qwen3.5 / Qwen3.6 / Qwen3-Next) keeps, per sequence, the last `conv_width - 1`
inputs of its causal convolution over `conv_dim` channels, and one [key_dim, value_dim] delta-rule matrix
per value head. The pool keeps one such state per slot of a layer group of kind "state"
(kv/layer_groups.py); a slot is either a sequence's running state or a checkpoint: the state after the
first b * block_size tokens of a prompt, registered in the prefix cache under block b - 1's key.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StateShape:
    """One recurrent layer's per-sequence state: its convolution's window and its delta-rule matrices."""

    conv_dim: int  # channels of the causal convolution (query, key and value projections together)
    conv_width: int  # the convolution's kernel size; the state keeps the last conv_width - 1 inputs
    num_heads: int  # value heads, one matrix each
    key_dim: int
    value_dim: int

    def __post_init__(self) -> None:
        for name in ("conv_dim", "conv_width", "num_heads", "key_dim", "value_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"state shape: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def conv_elements(self) -> int:
        return self.conv_dim * (self.conv_width - 1)

    @property
    def matrix_elements(self) -> int:
        return self.num_heads * self.key_dim * self.value_dim

    def nbytes(self, conv_bytes: int, matrix_bytes: int) -> int:
        """Bytes of one state with the convolution's inputs at `conv_bytes` each and the matrices at
        `matrix_bytes` per element."""
        return self.conv_elements * conv_bytes + self.matrix_elements * matrix_bytes
