"""The Triton attention backend: store_kv and paged_attention over the same paged pool as the torch backend.

It reads and writes the bytes the torch codecs define (kv/codecs.py): each layer's codecs give the kernels
their format parameters once (`KVCodec.kernel_format`), the query is mapped into the key store's domain
and the output back from the value store's domain exactly as the torch backend does, and the per-step
plan (tiles, splits) is built once per step, by the first layer, and shared by the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from localserve.attention.base import AttentionBackend, AttentionGeometry, AttentionInputs
from localserve.attention.torch_backend import check_layer_cache
from localserve.kernels.attention_plan import AttentionPlan, plan_attention
from localserve.kernels.kv_format import KernelFormat, KVStore
from localserve.kernels.paged_attention import paged_attention, prefill_rows_cap
from localserve.kernels.rotary import rotary_halves
from localserve.kernels.store_kv import store_kv

if TYPE_CHECKING:
    from localserve.kv.cache import PagedKVCache
    from localserve.kv.formats import KVFormatSpec

COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # model dtypes, and the plain formats read
MAX_KERNEL_HEAD_DIM = 512


def head_dim_reason(head_dim: int) -> str | None:
    """Why the kernels cannot take heads of `head_dim` values; None when they can."""
    if head_dim < 16 or head_dim > MAX_KERNEL_HEAD_DIM or head_dim & (head_dim - 1):
        return f"its kernels need a head size that is a power of two from 16 to {MAX_KERNEL_HEAD_DIM}"
    return None


def kv_store(store: dict[str, torch.Tensor]) -> KVStore:
    """The kernels' view of one layer's K or V tensors of a PagedKVCache."""
    return KVStore(store["values"]) if "values" in store else KVStore(store["codes"], store["scales"])


@dataclass
class TritonAttentionMetadata:
    """One step's inputs and its kernel plans: built by the first layer of each kind (which knows the head
    counts), or given up front (a captured CUDA graph's static plan, then used by every layer)."""

    inputs: AttentionInputs
    plan: AttentionPlan | None = None
    plans: dict[tuple, AttentionPlan] = field(default_factory=dict)
    key_limits: torch.Tensor | None = None  # inputs.key_limits as int32, made by the first layer that reads them


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels: compiled on CUDA; in Triton's interpreter on a CPU
    (TRITON_INTERPRET=1), which only the tests use."""

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits  # None: chosen per step from the batch and the device
        self._formats: dict[tuple[PagedKVCache, int], tuple[KernelFormat, KernelFormat]] = {}
        self._trig_tables: dict[tuple[int, int], torch.Tensor] = {}  # by head size and rope
        self._num_sms: int | None = None

    @classmethod
    def unsupported_reason(cls, device: torch.device, key_format: KVFormatSpec, value_format: KVFormatSpec,
                           head_dim: int) -> str | None:
        if device.type != "cuda":
            return "its kernels compile for CUDA devices only"
        if head_dim_reason(head_dim):
            return f"{head_dim_reason(head_dim)}, this model's is {head_dim}"
        import triton  # noqa: F401  (an ImportError says it is missing)

        for spec in (key_format, value_format):
            if spec.dtype_name is not None and getattr(torch, spec.dtype_name) not in COMPUTE_DTYPES:
                return f"its kernels do not read a {spec} KV cache"
        return None

    @classmethod
    def unsupported_layer(cls, layer: int, geometry: AttentionGeometry) -> str | None:
        reason = head_dim_reason(geometry.head_dim)
        return None if reason is None else f"{reason}, layer {layer}'s is {geometry.head_dim}"

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(inputs)

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, metadata: TritonAttentionMetadata,
                geometry: AttentionGeometry | None = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> output [T, H, D]; writes key/value into the pool first."""
        geometry = geometry or AttentionGeometry.plain(query, key)
        reason = self.unsupported_layer(layer, geometry)
        if reason is not None:
            raise ValueError(f"the Triton attention backend cannot compute layer {layer}: {reason}")
        check_layer_cache(layer, geometry, kv_cache)
        key_format, value_format = self.layer_formats(kv_cache, layer, query.device)
        inputs = metadata.inputs
        _, slot_mapping, _ = inputs.tables_of(layer)
        token_trig = None
        if key_format.key_mean is not None:
            table = self.rotary_table(kv_cache, max(inputs.context_lens, default=1), query.device, layer)
            token_trig = table.index_select(0, inputs.positions)
        store_kv(key, slot_mapping, kv_store(kv_cache.key_stores[layer]), key_format, token_trig)
        if not kv_cache.keys_are_values(layer):
            store_kv(key if geometry.keys_are_values else value, slot_mapping, kv_store(kv_cache.value_stores[layer]),
                     value_format)
        return self.attend(layer, query, kv_cache, metadata, geometry)

    def attend(self, layer: int, query: torch.Tensor, kv_cache: PagedKVCache, metadata: TritonAttentionMetadata,
               geometry: AttentionGeometry | float | None = None) -> torch.Tensor:
        """Attention of query [T, H, D] over what the pool holds (the step's own K/V already written), as the
        layer's `geometry` says (a float: only the scale of the logits; None: 1/sqrt(D), nothing else)."""
        if query.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"the Triton attention backend computes in fp16, bf16 or fp32, not {query.dtype}")
        num_kv_heads = kv_cache.key_codecs[layer].num_kv_heads
        if not isinstance(geometry, AttentionGeometry):
            scale = 1 / math.sqrt(query.shape[-1]) if geometry is None else geometry
            geometry = AttentionGeometry(query.shape[1], num_kv_heads, query.shape[2], scale)
        key_format, value_format = self.layer_formats(kv_cache, layer, query.device)
        plan = metadata.plan or self.layer_plan(metadata, layer, geometry, query.device,
                                                prefill_rows_cap(query.dtype, key_format.code, value_format.code,
                                                                 geometry.head_dim))
        if plan.block_m < geometry.num_heads // num_kv_heads:  # a static plan made for another layer's heads
            raise ValueError(f"layer {layer}'s {geometry.num_heads // num_kv_heads} query heads per KV head do not "
                             f"fit the step plan's tiles of {plan.block_m} rows")
        transformed = kv_cache.transform_query(layer, query)
        coeff = trig_table = None
        if key_format.key_mean is not None:
            grouped = transformed.float().unflatten(1, (num_kv_heads, -1))
            coeff = torch.einsum("gje,tgke->tgkj", key_format.key_mean, grouped).flatten(1, 2).contiguous()
            trig_table = self.rotary_table(kv_cache, plan.max_seq_len, query.device, layer)
        key_limits = None
        if metadata.inputs.key_limits is not None:  # a bidirectional image span in a chunk (rare: else no loads)
            if metadata.key_limits is None:
                metadata.key_limits = metadata.inputs.key_limits.to(torch.int32)
            key_limits = metadata.key_limits
        output = paged_attention(transformed.contiguous(), kv_store(kv_cache.key_stores[layer]),
                                 kv_store(kv_cache.value_stores[layer]), key_format, value_format, plan,
                                 geometry.scale, coeff, trig_table, window=geometry.sliding_window,
                                 sinks=geometry.sinks, softcap=geometry.logit_softcap, key_limits=key_limits)
        return kv_cache.restore_output(layer, output)

    def layer_plan(self, metadata: TritonAttentionMetadata, layer: int, geometry: AttentionGeometry,
                   device: torch.device, max_block_m: int | None = None) -> AttentionPlan:
        """The step's plan for `layer`'s kind (KV group, KV heads, head size, window, row cap), made on first
        use (`max_block_m`: the most query rows a tile of its operands may have)."""
        group, _, tables = metadata.inputs.tables_of(layer)
        kind = (group, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, geometry.sliding_window,
                max_block_m)
        if kind not in metadata.plans:
            metadata.plans[kind] = self.plan(metadata.inputs, geometry.num_heads, geometry.num_kv_heads, device,
                                             block_tables=tables, head_dim=geometry.head_dim,
                                             window=geometry.sliding_window, max_block_m=max_block_m)
        return metadata.plans[kind]

    def plan(self, inputs: AttentionInputs, num_heads: int, num_kv_heads: int, device: torch.device,
             num_tiles: int | None = None, block_tables: torch.Tensor | None = None, head_dim: int = 128,
             window: int | None = None, max_block_m: int | None = None) -> AttentionPlan:
        """The kernel plan of a step: query tiles, tile shape and KV splits (`num_tiles`: pad to a fixed grid;
        `block_tables`: a KV group's, default the inputs'; `max_block_m`: a cap on the query rows a tile)."""
        if self._num_sms is None and device.type == "cuda":
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        tables = inputs.block_tables if block_tables is None else block_tables
        return plan_attention(inputs.query_lens, inputs.context_lens, tables, num_heads, num_kv_heads,
                              num_splits=self.num_splits, num_sms=self._num_sms, num_tiles=num_tiles,
                              head_dim=head_dim, window=window, max_block_m=max_block_m)

    def layer_formats(self, kv_cache: PagedKVCache, layer: int,
                      device: torch.device) -> tuple[KernelFormat, KernelFormat]:
        """The kernel formats of one layer's K and V, built on first use."""
        key = (kv_cache, layer)
        if key not in self._formats:
            self._formats[key] = (kv_cache.key_codecs[layer].kernel_format(device),
                                  kv_cache.value_codecs[layer].kernel_format(device))
        return self._formats[key]

    def rotary_table(self, kv_cache: PagedKVCache, length: int, device: torch.device,
                     layer: int | None = None) -> torch.Tensor:
        """cos | sin halves [P, D] fp32 at positions 0..P-1, P >= length, from the rotary embedding of
        `layer`'s 4-bit keys (None: the first such layer's); one per head size and rope, grown by doubling, then
        reused (a captured graph reserves its whole length first)."""
        codecs = kv_cache.key_codecs if layer is None else [kv_cache.key_codecs[layer]]
        codec = next(codec for codec in codecs if codec.needs_positions)
        kind = (codec.head_dim, id(codec.rope))
        table = self._trig_tables.get(kind)
        if table is None or table.shape[0] < length:
            size = max(256, 1 << max(length - 1, 1).bit_length())
            table = self._trig_tables[kind] = rotary_halves(*codec.rope(torch.arange(size, device=device)))
        return table
