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

A state group (recurrent layers, kv/state_group.py) holds slots, not tokens: its pool's bytes come off the
budget first, `state_pool_slots` of them, max_num_seqs x 2 + ceil(chunk_tokens / (checkpoint_blocks x
block_size)) + 1 + state_cache_slots (without chunked prefill: max_model_len instead of chunk_tokens). A
sequence at rest holds one slot, its running state, and the scheduler admits a request only while each pool
keeps one more per running sequence (engine/admission.py: a decode's headroom); a sequence prefilling a
chunk holds at most ceil(chunk_tokens / (checkpoint_blocks x block_size)) + 2 more (the periodic
checkpoints inside the chunk, the prompt's end checkpoint, the slot the step's final state goes to). So
max_num_seqs sequences run at once when the last one's first chunk fits beside the others' 2 x
(max_num_seqs - 1): 2 x max_num_seqs + ceil(...) + 1. Fewer slots never break a sequence, only
concurrency: admission takes a first chunk's slots all or none (else the request waits), later chunks are
cut to the slots there are, and a decode short of a slot preempts (kv/state_group.py). The
`state_cache_slots` more keep checkpoints of finished prompts for the prefix cache (freed checkpoints stay
cached in any free slot besides). A slot is one state of every recurrent layer: its convolution's inputs in
the model's dtype and its delta-rule matrices in float32 (`GroupPool.slot_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from localserve.kv.formats import KVFormatSpec
from localserve.kv.layer_groups import RECURRENT, GroupWindow, KVGroup, group_layers, max_blocks_in_window
from localserve.kv.state_shape import StateShape

MATRIX_BYTES = 4
"""Bytes of one delta-rule matrix element: the states keep float32 (kv/recurrent_states.py)."""

STATE_POOL_SHARE = 0.5
"""The most of the KV budget a state pool may take for sequences the user did not ask for: a recurrent state is
60-150 MiB on Qwen3.6 models, so the default 16 sequences' pool would leave a 24 GB card no KV for their
attention layers (or not fit at all); `fit_state_sequences` runs fewer then, and the other half stays for KV."""


class LayerKV(Protocol):
    """What sizes one layer's KV or state (a models.config.LayerAttention has it)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    keys_are_values: bool
    state: StateShape | None  # a recurrent layer: no KV, this state per slot


class LayeredShape(Protocol):
    """A model's layers as the pool keeps them (a ModelConfig has it)."""

    num_layers: int

    def attention_of(self, layer: int) -> LayerKV: ...


@dataclass(frozen=True)
class GroupPool:
    """One group's pool as planned: its layers, bytes per token over them, and its blocks (a state group:
    no bytes per token, its slots and `slot_bytes`, one slot's bytes over its layers)."""

    group: KVGroup
    bytes_per_token: int
    num_blocks: int
    slot_bytes: int = 0

    @property
    def label(self) -> str:
        return self.group.label

    def pool_bytes(self, block_size: int) -> int:
        """The pool's bytes with blocks of `block_size` tokens (a state group: its slots')."""
        return self.num_blocks * (self.slot_bytes if self.group.recurrent else self.bytes_per_token * block_size)


def layer_windows(shape: LayeredShape) -> list[GroupWindow]:
    """Each layer's sliding window (None: full attention, `RECURRENT`: a recurrent layer)."""
    kinds = []
    for layer in range(shape.num_layers):
        attention = shape.attention_of(layer)
        kinds.append(RECURRENT if getattr(attention, "state", None) is not None else attention.sliding_window)
    return kinds


def state_slot_bytes(shape: LayeredShape, layers: tuple[int, ...], conv_bytes: int) -> int:
    """Bytes of one state slot over these recurrent layers: conv inputs at `conv_bytes` (the model's dtype),
    matrices in float32."""
    return sum(shape.attention_of(layer).state.nbytes(conv_bytes, MATRIX_BYTES) for layer in layers)


def state_pool_slots(block_size: int, max_num_seqs: int, max_model_len: int, chunk_tokens: int | None,
                     checkpoint_blocks: int, cache_slots: int = 0) -> int:
    """Slots a state group's pool needs (the module doc's rule; `chunk_tokens` None: no chunked prefill)."""
    if checkpoint_blocks < 1 or cache_slots < 0:
        raise ValueError(f"need state checkpoint blocks >= 1 and state cache slots >= 0, got {checkpoint_blocks}, "
                         f"{cache_slots}")
    tokens = max_model_len if chunk_tokens is None else chunk_tokens
    return 2 * max_num_seqs + -(-tokens // (checkpoint_blocks * block_size)) + 1 + cache_slots


def fit_state_sequences(slot_bytes: int, kv_budget: int, block_size: int, max_num_seqs: int, max_model_len: int,
                        chunk_tokens: int | None, checkpoint_blocks: int, cache_slots: int | None,
                        share: float = STATE_POOL_SHARE) -> int:
    """The most sequences, at most `max_num_seqs` and at least 1, whose state pool (`state_pool_slots`, with
    `cache_slots` cache slots; None: one per sequence) of `slot_bytes` slots takes at most `share` of
    `kv_budget` bytes (1 when even one sequence's takes more: the plan then says whether it fits at all)."""
    if slot_bytes <= 0 or kv_budget < 0 or not 0 < share <= 1 or max_num_seqs < 1:
        raise ValueError(f"need slot bytes > 0, a budget >= 0, a share in (0, 1] and max_num_seqs >= 1; got "
                         f"{slot_bytes}, {kv_budget}, {share}, {max_num_seqs}")

    def pool_bytes(num_seqs: int) -> int:
        slots = state_pool_slots(block_size, num_seqs, max_model_len, chunk_tokens, checkpoint_blocks,
                                 num_seqs if cache_slots is None else cache_slots)
        return slots * slot_bytes

    num_seqs = max_num_seqs
    while num_seqs > 1 and pool_bytes(num_seqs) > kv_budget * share:
        num_seqs -= 1
    return num_seqs


def layer_bytes_per_token(layer: LayerKV, key_format: KVFormatSpec, value_format: KVFormatSpec) -> int:
    """Bytes one token's K and V take in one layer (K only where the keys are the values; none in a
    recurrent layer, which keeps a state per sequence instead)."""
    if getattr(layer, "state", None) is not None:
        return 0
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
                     kv_budget: int | None, block_size: int, max_num_seqs: int, max_model_len: int,
                     chunk_tokens: int | None, state_checkpoint_blocks: int = 1, state_cache_slots: int = 0,
                     state_conv_bytes: int = 2) -> list[GroupPool]:
    """Each group's pool in `kv_budget` bytes, group 0 first: the state group's slots by its rule off the
    budget first, window groups by theirs, capped at the full group's size, the full group the rest.
    `kv_budget` None: the groups and the state pool only, every KV group 0 blocks (the caller sizes them).
    Raises ValueError when a format cannot store a layer's heads, or the budget cannot hold the state pool
    (saying by how much)."""
    groups = group_layers(layer_windows(shape))
    state_pools = []
    if groups[-1].recurrent:
        state_group = groups.pop()
        slot_bytes = state_slot_bytes(shape, state_group.layers, state_conv_bytes)
        num_slots = state_pool_slots(block_size, max_num_seqs, max_model_len, chunk_tokens, state_checkpoint_blocks,
                                     state_cache_slots)
        state_pools.append(GroupPool(state_group, 0, num_slots, slot_bytes))
        if kv_budget is not None:
            if num_slots * slot_bytes > kv_budget:
                need = num_slots * slot_bytes
                raise ValueError(
                    f"the recurrent state pool needs {num_slots} slots of {slot_bytes:,} bytes, {need:,} bytes "
                    f"({need / 2 ** 20:,.1f} MiB: {max_num_seqs} sequences, a state checkpoint every "
                    f"{state_checkpoint_blocks * block_size} tokens, {state_cache_slots} cache slots): "
                    f"{need - kv_budget:,} bytes ({(need - kv_budget) / 2 ** 20:,.1f} MiB) more than the KV budget of "
                    f"{kv_budget:,} bytes; give more memory, or lower -np (fewer sequences), --state-cache-slots, "
                    f"--max-num-batched-tokens (shorter prefill chunks) or raise --state-checkpoint-tokens")
            kv_budget -= num_slots * slot_bytes
        if not groups:
            return state_pools
    return _plan_kv_pools(shape, groups, key_format, value_format, kv_budget or 0, block_size, max_num_seqs,
                          max_model_len, chunk_tokens) + state_pools


def _plan_kv_pools(shape: LayeredShape, groups: list[KVGroup], key_format: KVFormatSpec, value_format: KVFormatSpec,
                   kv_budget: int, block_size: int, max_num_seqs: int, max_model_len: int,
                   chunk_tokens: int | None) -> list[GroupPool]:
    """The full and window groups' pools in `kv_budget` bytes (`plan_group_pools`)."""
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
