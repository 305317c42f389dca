"""Sizing the pools of a model's layer groups (kv/layer_groups.py) from a byte budget. No torch here.

A full-attention group keeps every token of every sequence, so it takes what the budget leaves; a window
group's need is bounded, and its pool is sized by this rule (`window_pool_blocks`), never more blocks
than the full group has:

- with chunked prefill (chunks of at most `chunk_tokens`, the step's token budget): the block manager
  gives a sequence window slots a chunk at a time, so each slot holds at most its window and one chunk:
  max_num_seqs x (ceil((W + chunk - 1) / block_size) + 1) blocks, and no sequence ever waits for one;
- without: a window group takes all of a prompt's blocks at admission, as a full group does, and gives
  them back as the prefill passes them: max_num_seqs x (ceil(W / block_size) + 1) decoding slots plus
  one longest prompt, ceil(max_model_len / block_size).

Where a model has only window groups, they share the budget like layers of one pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from localserve.kv.formats import KVFormatSpec
from localserve.kv.layer_groups import KVGroup, group_label, group_layers, max_blocks_in_window


class LayerKV(Protocol):
    """What sizes one layer's KV (a models.config.LayerAttention has it)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    keys_are_values: bool


class LayeredShape(Protocol):
    """A model's layers as the pool keeps them (a ModelConfig has it)."""

    num_layers: int

    def attention_of(self, layer: int) -> LayerKV: ...


@dataclass(frozen=True)
class GroupPool:
    """One group's pool as planned: its layers, bytes per token over them, and its blocks."""

    group: KVGroup
    bytes_per_token: int
    num_blocks: int

    @property
    def label(self) -> str:
        return group_label(self.group.sliding_window)


def layer_windows(shape: LayeredShape) -> list[int | None]:
    """Each layer's sliding window (None: full attention)."""
    return [shape.attention_of(layer).sliding_window for layer in range(shape.num_layers)]


def layer_bytes_per_token(layer: LayerKV, key_format: KVFormatSpec, value_format: KVFormatSpec) -> int:
    """Bytes one token's K and V take in one layer (K only where the keys are the values)."""
    key_bytes = key_format.bytes_per_vector(layer.head_dim)
    value_bytes = 0 if layer.keys_are_values else value_format.bytes_per_vector(layer.head_dim)
    return layer.num_kv_heads * (key_bytes + value_bytes)


def window_pool_blocks(sliding_window: int, block_size: int, max_num_seqs: int, max_model_len: int,
                       chunk_tokens: int | None) -> int:
    """Blocks a window group's pool needs (the module doc's rule; `chunk_tokens` None: no chunked prefill)."""
    if chunk_tokens is not None:
        return max_num_seqs * max_blocks_in_window(sliding_window, block_size, chunk_tokens)
    return max_num_seqs * max_blocks_in_window(sliding_window, block_size) + -(-max_model_len // block_size)


def plan_group_pools(shape: LayeredShape, key_format: KVFormatSpec, value_format: KVFormatSpec,
                     kv_budget: int, block_size: int, max_num_seqs: int, max_model_len: int,
                     chunk_tokens: int | None) -> list[GroupPool]:
    """Each group's pool in `kv_budget` bytes, group 0 first: window groups by the rule, capped at the full
    group's size, the full group the rest. Raises ValueError when a format cannot store a layer's heads."""
    groups = group_layers(layer_windows(shape))
    per_token = [sum(layer_bytes_per_token(shape.attention_of(layer), key_format, value_format)
                     for layer in group.layers) for group in groups]
    if groups[0].sliding_window is not None or len(groups) == 1:  # one pool's worth: every group alike
        num_blocks = max(0, kv_budget // (sum(per_token) * block_size))
        return [GroupPool(group, size, num_blocks) for group, size in zip(groups, per_token, strict=True)]
    wanted = [window_pool_blocks(group.sliding_window, block_size, max_num_seqs, max_model_len, chunk_tokens)
              for group in groups[1:]]
    # The full group gets what the window pools leave; a window pool wanting more than the full group has
    # is held to its size instead (it never needs more): those grow with the full group, the others are fixed.
    tracking = set()
    while True:
        fixed_bytes = sum(blocks * size for index, (blocks, size) in enumerate(zip(wanted, per_token[1:]))
                          if index not in tracking) * block_size
        growing = per_token[0] + sum(per_token[1 + index] for index in tracking)
        num_full_blocks = max(0, (kv_budget - fixed_bytes) // (growing * block_size))
        newly = {index for index, blocks in enumerate(wanted) if blocks > num_full_blocks} - tracking
        if not newly:
            break
        tracking |= newly
    pools = [GroupPool(groups[0], per_token[0], num_full_blocks)]
    pools += [GroupPool(group, size, num_full_blocks if index in tracking else wanted[index])
              for index, (group, size) in enumerate(zip(groups[1:], per_token[1:], strict=True))]
    return pools
