"""The attention backend interface and the per-step inputs every backend builds its metadata from.

The model runner turns the scheduler's step contract (localserve.engine.step) into `AttentionInputs`
once per step; the chosen backend's `build_metadata` derives what its kernels need from them (the
torch backend: gather slots and masks per group; a Triton backend: int32 tables, split counts), and
every layer's `forward` reuses that metadata. Each layer describes its own attention (`AttentionGeometry`)
and hands that description to `forward` with its tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from localserve.kv.cache import PagedKVCache
    from localserve.kv.formats import KVFormatSpec


@dataclass
class AttentionInputs:
    """Where each new token's K/V goes and what each sequence attends to, as tensors on the device.

    Tokens of one sequence are contiguous in the batch, sequences in `query_lens` order; each attends
    causally to its own context (its earlier tokens and its new ones) through its block table.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset written by each token
    positions: torch.Tensor  # [num_tokens] int64: position of each new token in its sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64; entries past a sequence's blocks are unused
    query_lens: list[int]  # [num_seqs] new tokens per sequence in this step
    context_lens: list[int]  # [num_seqs] tokens each sequence attends to, these new tokens included
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def for_prompt(cls, num_tokens: int, block_table: list[int], block_size: int,
                   device: torch.device | str) -> AttentionInputs:
        """One sequence's whole prompt as a single chunk, written from position 0."""
        positions = torch.arange(num_tokens, device=device)
        table = torch.tensor([block_table], dtype=torch.int64, device=device)
        slots = table[0, positions // block_size] * block_size + positions % block_size
        return cls(slots, positions, table, [num_tokens], [num_tokens], block_size)


@dataclass(frozen=True, eq=False)
class AttentionGeometry:
    """One attention layer as it describes itself to the backend: its heads, KV heads, head size, the scale
    of its logits, and the features a family may turn on per layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # each query sees only its last `sliding_window` keys
    sinks: torch.Tensor | None = None  # [num_heads] a learned logit per head that takes probability, no value
    logit_softcap: float | None = None  # logits squashed to cap * tanh(logits / cap)

    @classmethod
    def plain(cls, query: torch.Tensor, key: torch.Tensor) -> AttentionGeometry:
        """The geometry of query [T, H, D] and key [T, Hkv, D] with the usual 1/sqrt(D) and no extras."""
        return cls(query.shape[1], key.shape[1], query.shape[2], query.shape[2] ** -0.5)

    def check_plain(self, backend: str) -> None:
        """Raise NotImplementedError naming a feature the backends do not compute yet."""
        for feature, value in (("a sliding window", self.sliding_window), ("attention sinks", self.sinks),
                               ("a logit soft-cap", self.logit_softcap)):
            if value is not None:
                raise NotImplementedError(f"the {backend} attention backend does not compute {feature} yet")


class AttentionBackend(ABC):
    """Writes one layer's new K/V into the paged cache and attends over it."""

    name: ClassVar[str]

    @classmethod
    def unsupported_reason(cls, device: torch.device, key_format: KVFormatSpec, value_format: KVFormatSpec,
                           head_dim: int) -> str | None:
        """Why this backend cannot run on `device` with these KV formats and head size; None when it can."""
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
