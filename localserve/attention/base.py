"""The attention backend interface and the per-step inputs every backend builds its metadata from.

The model runner turns the scheduler's step contract (localserve.engine.step) into `AttentionInputs`
once per step; the chosen backend's `build_metadata` derives what its kernels need from them (the
torch backend: gather slots and masks per group; a Triton backend: int32 tables, split counts), and
every layer's `forward` reuses that metadata. Each layer describes its own attention (`AttentionGeometry`)
and hands that description to `forward` with its tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from localserve.kv.cache import PagedKVCache
    from localserve.kv.formats import KVFormatSpec


@dataclass
class GroupTables:
    """One KV group's tables: where each new token is written and each sequence's blocks, in the group's
    own block ids. In a window layer's group, entries of logical blocks wholly before the window of a
    sequence's first query of the step may be -1 or garbage: no backend reads them."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64


@dataclass
class AttentionInputs:
    """Where each new token's K/V goes and what each sequence attends to, as tensors on the device.

    Tokens of one sequence are contiguous in the batch, sequences in `query_lens` order; each attends
    causally to its own context (its earlier tokens and its new ones) through its block table, or up to its
    `key_limits` entry where given.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset written by each token
    positions: torch.Tensor  # [num_tokens] int64: position of each new token in its sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64; entries past a sequence's blocks are unused
    query_lens: list[int]  # [num_seqs] new tokens per sequence in this step
    context_lens: list[int]  # [num_seqs] tokens each sequence attends to, these new tokens included
    block_size: int
    # Per-group tables where layers keep KV in groups of their own (full attention, a window of W): each
    # group is its own block id space. Empty: one group, the fields above. `layer_groups[i]`: layer i's.
    groups: list[GroupTables] = field(default_factory=list)
    layer_groups: list[int] = field(default_factory=list)
    # [num_tokens] int64: the last key position each query token sees, at least its own and within its
    # context (a token of a bidirectional image span sees the span's last: engine/multimodal.py, `key_limits`);
    # None: each sees up to its own position. A window's lower bound stays each query's own position - W + 1.
    key_limits: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def tables_of(self, layer: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(group index, slot_mapping [T], block_tables [S, max_blocks]) of `layer`'s KV group."""
        if not self.groups:
            return 0, self.slot_mapping, self.block_tables
        index = self.layer_groups[layer] if self.layer_groups else 0
        return index, self.groups[index].slot_mapping, self.groups[index].block_tables

    @classmethod
    def for_prompt(cls, num_tokens: int, block_table: list[int], block_size: int,
                   device: torch.device | str) -> AttentionInputs:
        """One sequence's whole prompt as a single chunk, written from position 0."""
        positions = torch.arange(num_tokens, device=device)
        table = torch.tensor([block_table], dtype=torch.int64, device=device)
        slots = table[0, positions // block_size] * block_size + positions % block_size
        return cls(slots, positions, table, [num_tokens], [num_tokens], block_size)


MAX_HEAD_DIM = 512  # the largest head size a layer may have (Gemma 4's global layers)


@dataclass(frozen=True, eq=False)
class AttentionGeometry:
    """One attention layer as it describes itself to the backend: its heads, KV heads, head size, the scale
    of its logits, and the features a family may turn on per layer.

    - `sliding_window` W: the query at position p sees the keys at positions p - W + 1 .. p, its last W
      keys including its own (transformers' convention for gpt-oss, Gemma 2/3/4 and Mistral: the mask
      keeps `kv_idx > q_idx - W`; tests/attention/test_geometry_reference.py pins it against their code).
    - `sinks` [H] fp32: a learned logit per query head that joins the softmax denominator and carries no
      value (gpt-oss); the probabilities of the real keys then sum to less than one.
    - `logit_softcap` c: logits = c * tanh(s / c) with s = q . k * scale (the scale applies first).
    - `keys_are_values`: the value of each key is the key itself (as stored: after the layer's norm and
      rotary embedding); the layer's cache keeps no value store.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    sinks: torch.Tensor | None = None
    logit_softcap: float | None = None
    keys_are_values: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads cannot share {self.num_kv_heads} KV heads evenly")
        if not 0 < self.head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"head size {self.head_dim}: attention takes head sizes 1 to {MAX_HEAD_DIM}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding window {self.sliding_window}: a window holds at least one key")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit soft-cap {self.logit_softcap}: the cap must be positive")
        if self.sinks is not None and tuple(self.sinks.shape) != (self.num_heads,):
            raise ValueError(f"sinks of shape {tuple(self.sinks.shape)}: one logit per query head "
                             f"({self.num_heads}) expected")

    @classmethod
    def plain(cls, query: torch.Tensor, key: torch.Tensor) -> AttentionGeometry:
        """The geometry of query [T, H, D] and key [T, Hkv, D] with the usual 1/sqrt(D) and no extras."""
        return cls(query.shape[1], key.shape[1], query.shape[2], query.shape[2] ** -0.5)

    def window_start(self, position: int) -> int:
        """The first key position the query at `position` sees."""
        return 0 if self.sliding_window is None else max(0, position - self.sliding_window + 1)

    def describe(self) -> str:
        """A short account for logs and errors: 'H 8 / KV 2 x 128, window 128, sinks'."""
        parts = [f"H {self.num_heads} / KV {self.num_kv_heads} x {self.head_dim}"]
        if self.sliding_window is not None:
            parts.append(f"window {self.sliding_window}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.logit_softcap is not None:
            parts.append(f"soft-cap {self.logit_softcap:g}")
        if self.keys_are_values:
            parts.append("K = V")
        return ", ".join(parts)


class AttentionBackend(ABC):
    """Writes one layer's new K/V into the paged cache and attends over it."""

    name: ClassVar[str]

    @classmethod
    def unsupported_reason(cls, device: torch.device, key_format: KVFormatSpec, value_format: KVFormatSpec,
                           head_dim: int) -> str | None:
        """Why this backend cannot run on `device` with these KV formats and head size; None when it can."""
        return None

    @classmethod
    def unsupported_layer(cls, layer: int, geometry: AttentionGeometry) -> str | None:
        """Why this backend cannot compute `layer` as `geometry` describes it, naming the layer and the
        value; None when it can."""
        return None

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> Any:
        """This backend's per-step metadata, built once and passed to every layer's forward."""

    @abstractmethod
    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, metadata: Any, geometry: AttentionGeometry | None = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> output [T, H, D]; writes key/value into the cache.

        `geometry`: the layer's description (a model always gives it); None: `AttentionGeometry.plain`.
        """
