"""The Triton attention backend: store_kv and paged_attention over the same paged pool as the torch backend.

It reads and writes the bytes the torch codecs define (kv_formats.py): each layer's codecs are turned
once into the kernels' format parameters, the query is mapped into the key store's domain and the output
back from the value store's domain exactly as the torch backend does, and the per-step plan (tiles,
splits) and rotary tables are built once per step and shared by every layer.
"""

from __future__ import annotations

import math

import torch

from localserve.attention import AttentionMetadata, token_positions
from localserve.kernels.attention_plan import AttentionPlan, plan_attention
from localserve.kernels.kv_format import PLAIN, Q4, Q8_0, KernelFormat, KVStore, fold_key_mean, q4_midpoints
from localserve.kernels.paged_attention import paged_attention
from localserve.kernels.store_kv import store_kv
from localserve.kv_cache import PagedKVCache
from localserve.kv_formats import KVCodec, PassthroughCodec, Q4Codec, Q8Codec

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # model dtypes and plain store dtypes


def unsupported_reason(kv_cache: PagedKVCache, dtype: torch.dtype) -> str | None:
    """Why the Triton backend cannot serve this pool and model dtype, or None when it can."""
    if dtype not in SUPPORTED_DTYPES:
        return f"the Triton kernels compute in fp16, bf16 or fp32, not {dtype}"
    for codec in (kv_cache.key_codecs[0], kv_cache.value_codecs[0]):
        if isinstance(codec, PassthroughCodec) and codec.dtype not in SUPPORTED_DTYPES:
            return f"the Triton kernels do not read a {codec.name} KV cache"
    return None


def search_factors(device: torch.device) -> torch.Tensor:
    """The 16 RMS factors of the 4-bit scale search, computed as quantize_codebook computes them."""
    return torch.exp(torch.linspace(math.log(0.6), math.log(1.7), 16, device=device))


def kernel_format(codec: KVCodec, device: torch.device) -> KernelFormat:
    """The kernels' description of `codec`'s format, its tensors on `device`."""
    def on_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.float32).contiguous()

    heads, dim = codec.num_kv_heads, codec.head_dim
    if isinstance(codec, PassthroughCodec):
        return KernelFormat(PLAIN)
    if isinstance(codec, Q8Codec):
        rotation = on_device(codec.rotation).expand(heads, dim, dim) if codec.rotated else None
        return KernelFormat(Q8_0, encode_matrix=rotation)
    if not isinstance(codec, Q4Codec):
        raise ValueError(f"the Triton kernels do not know the {codec.name} format")
    encode = on_device(codec.encode_matrix)
    key_mean = value_mean = None
    if codec.mean is not None and codec.kind == "key":
        key_mean = fold_key_mean(encode, on_device(codec.mean))
    elif codec.mean is not None:
        value_mean = torch.einsum("ged,gd->ge", encode, on_device(codec.mean)).contiguous()
    levels = on_device(codec.levels)
    return KernelFormat(Q4, encode_matrix=encode if codec.rotated else None, levels=levels,
                        midpoints=q4_midpoints(levels),
                        search_factors=search_factors(device) if codec.options.codebook else None,
                        key_mean=key_mean, value_mean=value_mean)


def kv_store(store: dict[str, torch.Tensor]) -> KVStore:
    """The kernels' view of one layer's K or V tensors of a PagedKVCache."""
    return KVStore(store["values"]) if "values" in store else KVStore(store["codes"], store["scales"])


class TritonAttentionBackend:
    """Paged attention through the Triton kernels (compiled on CUDA, interpreted elsewhere, for tests)."""

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits  # None: chosen per step from the batch and the device
        self._formats: dict[tuple[PagedKVCache, int], tuple[KernelFormat, KernelFormat]] = {}
        self._step: AttentionMetadata | None = None
        self.step_plan: AttentionPlan | None = None  # the current step's plan (tiles, splits)
        self._token_trig: torch.Tensor | None = None
        self._trig_table: torch.Tensor | None = None

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: PagedKVCache, metadata: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> output [T, H, D]; writes key/value into the pool first."""
        key_format, value_format = self._layer_formats(kv_cache, layer, query.device)
        self._prepare_step(kv_cache, metadata, query)
        store_kv(key, metadata.slot_mapping, kv_store(kv_cache.key_stores[layer]), key_format, self._token_trig)
        store_kv(value, metadata.slot_mapping, kv_store(kv_cache.value_stores[layer]), value_format)
        return self.attend(layer, query, kv_cache, metadata)

    def attend(self, layer: int, query: torch.Tensor, kv_cache: PagedKVCache,
               metadata: AttentionMetadata) -> torch.Tensor:
        """Attention of query [T, H, D] over what the pool holds (the step's own K/V already written)."""
        key_format, value_format = self._layer_formats(kv_cache, layer, query.device)
        self._prepare_step(kv_cache, metadata, query)
        transformed = kv_cache.transform_query(layer, query)
        coeff = None
        if key_format.key_mean is not None:
            grouped = transformed.float().unflatten(1, (kv_cache.key_codecs[layer].num_kv_heads, -1))
            coeff = torch.einsum("gje,tgke->tgkj", key_format.key_mean, grouped).flatten(1, 2).contiguous()
        output = paged_attention(transformed.contiguous(), kv_store(kv_cache.key_stores[layer]),
                                 kv_store(kv_cache.value_stores[layer]), key_format, value_format, self.step_plan,
                                 1 / math.sqrt(query.shape[-1]), coeff, self._trig_table)
        return kv_cache.restore_output(layer, output)

    def _layer_formats(self, kv_cache: PagedKVCache, layer: int,
                       device: torch.device) -> tuple[KernelFormat, KernelFormat]:
        key = (kv_cache, layer)
        if key not in self._formats:
            self._formats[key] = (kernel_format(kv_cache.key_codecs[layer], device),
                                  kernel_format(kv_cache.value_codecs[layer], device))
        return self._formats[key]

    def _prepare_step(self, kv_cache: PagedKVCache, metadata: AttentionMetadata, query: torch.Tensor) -> None:
        """Plan the step and, for a 4-bit key mean, its rotary tables; once per step, for every layer."""
        if self._step is metadata:
            return
        num_heads = query.shape[1]
        num_kv_heads = kv_cache.key_codecs[0].num_kv_heads
        num_sms = None
        if query.device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        self.step_plan = plan_attention(metadata.query_lens, metadata.context_lens, metadata.block_tables,
                                    num_heads, num_kv_heads, num_splits=self.num_splits, num_sms=num_sms)
        self._token_trig = None
        rope = next((c.rope for c in kv_cache.key_codecs if c.needs_positions), None)
        if rope is not None:
            self._trig_table = self._rotary_table(rope, self.step_plan.max_seq_len, query.device)
            positions = token_positions(metadata, query.device)
            self._token_trig = self._trig_table.index_select(0, positions)
        self._step = metadata

    def _rotary_table(self, rope, length: int, device: torch.device) -> torch.Tensor:
        """cos | sin halves [P, D] fp32 at positions 0..P-1, P >= length; grown by doubling, then reused."""
        if self._trig_table is None or self._trig_table.shape[0] < length:
            size = max(256, 1 << (length - 1).bit_length())
            cos, sin = rope(torch.arange(size, device=device))
            half = cos.shape[-1] // 2
            self._trig_table = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).float().contiguous()
        return self._trig_table
