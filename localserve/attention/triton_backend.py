"""The Triton attention backend: store_kv and paged_attention over the same paged pool as the torch backend.

It reads and writes the bytes the torch codecs define (kv/codecs.py): each layer's codecs give the kernels
their format parameters once (`KVCodec.kernel_format`), the query is mapped into the key store's domain
and the output back from the value store's domain exactly as the torch backend does, and the per-step
plan (tiles, splits) is built once per step, by the first layer, and shared by the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from localserve.attention.base import AttentionBackend, AttentionGeometry, AttentionInputs
from localserve.kernels.attention_plan import AttentionPlan, plan_attention
from localserve.kernels.kv_format import KernelFormat, KVStore
from localserve.kernels.paged_attention import paged_attention
from localserve.kernels.rotary import rotary_halves
from localserve.kernels.store_kv import store_kv

if TYPE_CHECKING:
    from localserve.kv.cache import PagedKVCache
    from localserve.kv.formats import KVFormatSpec

COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # model dtypes, and the plain formats read


def kv_store(store: dict[str, torch.Tensor]) -> KVStore:
    """The kernels' view of one layer's K or V tensors of a PagedKVCache."""
    return KVStore(store["values"]) if "values" in store else KVStore(store["codes"], store["scales"])


@dataclass
class TritonAttentionMetadata:
    """One step's inputs and its kernel plan: built by the first layer (which knows the head counts), or
    given up front (a captured CUDA graph's static plan)."""

    inputs: AttentionInputs
    plan: AttentionPlan | None = None


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels: compiled on CUDA; in Triton's interpreter on a CPU
    (TRITON_INTERPRET=1), which only the tests use."""

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits  # None: chosen per step from the batch and the device
        self._formats: dict[tuple[PagedKVCache, int], tuple[KernelFormat, KernelFormat]] = {}
        self._trig_table: torch.Tensor | None = None
        self._num_sms: int | None = None

    @classmethod
    def unsupported_reason(cls, device: torch.device, key_format: KVFormatSpec, value_format: KVFormatSpec,
                           head_dim: int) -> str | None:
        if device.type != "cuda":
            return "its kernels compile for CUDA devices only"
        if head_dim < 16 or head_dim & (head_dim - 1):
            return f"its kernels need a head size that is a power of two >= 16, this model's is {head_dim}"
        import triton  # noqa: F401  (an ImportError says it is missing)

        for spec in (key_format, value_format):
            if spec.dtype_name is not None and getattr(torch, spec.dtype_name) not in COMPUTE_DTYPES:
                return f"its kernels do not read a {spec} KV cache"
        return None

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(inputs)

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, metadata: TritonAttentionMetadata,
                geometry: AttentionGeometry | None = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> output [T, H, D]; writes key/value into the pool first."""
        geometry = geometry or AttentionGeometry.plain(query, key)
        geometry.check_plain(self.name)
        key_format, value_format = self.layer_formats(kv_cache, layer, query.device)
        inputs = metadata.inputs
        token_trig = None
        if key_format.key_mean is not None:
            table = self.rotary_table(kv_cache, max(inputs.context_lens, default=1), query.device)
            token_trig = table.index_select(0, inputs.positions)
        store_kv(key, inputs.slot_mapping, kv_store(kv_cache.key_stores[layer]), key_format, token_trig)
        store_kv(value, inputs.slot_mapping, kv_store(kv_cache.value_stores[layer]), value_format)
        return self.attend(layer, query, kv_cache, metadata, geometry.scale)

    def attend(self, layer: int, query: torch.Tensor, kv_cache: PagedKVCache, metadata: TritonAttentionMetadata,
               scale: float | None = None) -> torch.Tensor:
        """Attention of query [T, H, D] over what the pool holds (the step's own K/V already written);
        `scale` of the logits, 1/sqrt(D) when None."""
        if query.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"the Triton attention backend computes in fp16, bf16 or fp32, not {query.dtype}")
        key_format, value_format = self.layer_formats(kv_cache, layer, query.device)
        if metadata.plan is None:
            metadata.plan = self.plan(metadata.inputs, query.shape[1], kv_cache.key_codecs[layer].num_kv_heads,
                                      query.device)
        transformed = kv_cache.transform_query(layer, query)
        coeff = trig_table = None
        if key_format.key_mean is not None:
            grouped = transformed.float().unflatten(1, (kv_cache.key_codecs[layer].num_kv_heads, -1))
            coeff = torch.einsum("gje,tgke->tgkj", key_format.key_mean, grouped).flatten(1, 2).contiguous()
            trig_table = self.rotary_table(kv_cache, metadata.plan.max_seq_len, query.device)
        output = paged_attention(transformed.contiguous(), kv_store(kv_cache.key_stores[layer]),
                                 kv_store(kv_cache.value_stores[layer]), key_format, value_format, metadata.plan,
                                 1 / math.sqrt(query.shape[-1]) if scale is None else scale, coeff, trig_table)
        return kv_cache.restore_output(layer, output)

    def plan(self, inputs: AttentionInputs, num_heads: int, num_kv_heads: int, device: torch.device,
             num_tiles: int | None = None) -> AttentionPlan:
        """The kernel plan of a step: query tiles, tile shape and KV splits (`num_tiles`: pad to a fixed grid)."""
        if self._num_sms is None and device.type == "cuda":
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return plan_attention(inputs.query_lens, inputs.context_lens, inputs.block_tables, num_heads,
                              num_kv_heads, num_splits=self.num_splits, num_sms=self._num_sms, num_tiles=num_tiles)

    def layer_formats(self, kv_cache: PagedKVCache, layer: int,
                      device: torch.device) -> tuple[KernelFormat, KernelFormat]:
        """The kernel formats of one layer's K and V, built on first use."""
        key = (kv_cache, layer)
        if key not in self._formats:
            self._formats[key] = (kv_cache.key_codecs[layer].kernel_format(device),
                                  kv_cache.value_codecs[layer].kernel_format(device))
        return self._formats[key]

    def rotary_table(self, kv_cache: PagedKVCache, length: int, device: torch.device) -> torch.Tensor:
        """cos | sin halves [P, D] fp32 at positions 0..P-1, P >= length, from the 4-bit keys' rotary
        embedding; grown by doubling, then reused (a captured graph reserves its whole length first)."""
        if self._trig_table is None or self._trig_table.shape[0] < length:
            rope = next(codec.rope for codec in kv_cache.key_codecs if codec.needs_positions)
            size = max(256, 1 << max(length - 1, 1).bit_length())
            self._trig_table = rotary_halves(*rope(torch.arange(size, device=device)))
        return self._trig_table
