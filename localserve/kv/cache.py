"""The paged KV pool: per layer, K and V for `num_blocks` blocks of `block_size` tokens.

The block manager hands out block ids; this module owns the bytes behind them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from localserve.kv.calibration import KVCalibration
from localserve.kv.codecs import KVCodec, RopeFn, dtype_format, make_codec
from localserve.kv.formats import KVFormatSpec


class HostTransfers:
    """Copies between the pool's device and host memory, in order with the device's compute stream.

    Both directions are enqueued on the current (compute) stream, so a swap-out reads blocks after the
    forward passes that wrote them and before later writes reuse them, and the forward pass reads
    swapped-in blocks after they land. The host may read what a device-to-host copy brought only after
    `wait()`. Host staging buffers are pinned on CUDA, so the copies really run asynchronously; the
    caching host allocator keeps a pinned buffer from being reused until the copies using it are done.
    On the CPU the copies are plain and complete at once, and the same code path runs.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"

    def host_buffer(self, like: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """A host staging buffer for `num_blocks` blocks shaped like the store `like`."""
        return torch.empty((num_blocks, *like.shape[1:]), dtype=like.dtype, pin_memory=self.pinned)

    def to_host(self, host: torch.Tensor, source: torch.Tensor) -> None:
        """Enqueue the copy of device tensor `source` into `host`; read `host` only after `wait()`."""
        host.copy_(source, non_blocking=True)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Enqueue the copy of `host` to the device; device work enqueued after it sees the data."""
        return host.to(self.device, non_blocking=True)

    def wait(self) -> None:
        """Block until every copy enqueued so far on the compute stream has completed."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            event.synchronize()


@dataclass(frozen=True)
class LayerKVShape:
    """One layer's KV as the pool keeps it, where layers differ: its KV heads and head size, and whether
    its keys are also its values (then the layer has no value store: its value store is its key store).

    A keys-as-values layer stores its keys in the key format without the calibrated key transform and
    key mean (both are for keys only: read back as values, its keys must decode to themselves up to the
    format's fixed rotation, which the value side undoes like any rotated value); its `rope`: the layer's
    own rotary embedding for a 4-bit key mean (None: the pool's).
    """

    num_kv_heads: int
    head_dim: int
    keys_are_values: bool = False
    rope: RopeFn | None = None


class PagedKVCache:
    """K and V stores for each layer, indexed [num_blocks, block_size, ...] by block and offset.

    Each of K and V has its own format (`key_format`, `value_format`; default: the passthrough format of
    `dtype` itself, i.e. no quantization). A store is the format's tensors, each [num_blocks, block_size,
    *shape per token]: write() quantizes, gather_blocks() dequantizes only the gathered blocks, and copies
    and swaps move the stored bytes. Quantized 4-bit formats may use the model's `calibration` and its
    rotary embedding (`rope`: positions -> (cos, sin)) for the key mean.

    `layer_shapes`: one `LayerKVShape` per layer where layers differ (KV heads, head size, keys as
    values); None: every layer `num_kv_heads` x `head_dim` with its own values.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", num_cpu_blocks: int = 0,
                 key_format: KVFormatSpec | None = None, value_format: KVFormatSpec | None = None,
                 calibration: KVCalibration | None = None, rope: RopeFn | None = None,
                 layer_shapes: Sequence[LayerKVShape] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.key_format = key_format or dtype_format(dtype)
        self.value_format = value_format or dtype_format(dtype)
        if layer_shapes is None:
            layer_shapes = [LayerKVShape(num_kv_heads, head_dim)] * num_layers
        if len(layer_shapes) != num_layers:
            raise ValueError(f"{len(layer_shapes)} layer shapes for {num_layers} layers")
        self.layer_shapes = list(layer_shapes)
        layer_calibration = calibration.layer if calibration is not None else (lambda layer: None)
        self.key_codecs, self.value_codecs = [], []
        for i, shape in enumerate(self.layer_shapes):
            heads, dim, layer_rope = shape.num_kv_heads, shape.head_dim, shape.rope or rope
            if shape.keys_are_values:  # read back as values: no key-only transform or mean (see LayerKVShape)
                self.key_codecs.append(make_codec(self.key_format, "key", heads, dim, None, layer_rope))
                self.value_codecs.append(make_codec(self.key_format, "value", heads, dim, None, layer_rope))
            else:
                self.key_codecs.append(make_codec(self.key_format, "key", heads, dim, layer_calibration(i), layer_rope))
                self.value_codecs.append(make_codec(self.value_format, "value", heads, dim, layer_calibration(i),
                                                    layer_rope))
        self.needs_positions = any(c.needs_positions for c in self.key_codecs + self.value_codecs)
        self.transfers = HostTransfers(device)
        pin = self.transfers.pinned
        self.key_stores = [self._allocate(c, num_blocks, device) for c in self.key_codecs]
        self.value_stores = self._value_stores(self.key_stores, num_blocks, device)
        # The swap space: the same layout in CPU memory (pinned when the pool is on a GPU).
        self.cpu_key_stores = [self._allocate(c, num_cpu_blocks, "cpu", pin) for c in self.key_codecs]
        self.cpu_value_stores = self._value_stores(self.cpu_key_stores, num_cpu_blocks, "cpu", pin)

    def keys_are_values(self, layer: int) -> bool:
        """Whether `layer` keeps no value store (its value store is its key store)."""
        return self.layer_shapes[layer].keys_are_values

    def _value_stores(self, key_stores: list[dict[str, torch.Tensor]], num_blocks: int, device,
                      pin: bool = False) -> list[dict[str, torch.Tensor]]:
        """Each layer's value store: its key store itself where its keys are its values."""
        return [key_store if shape.keys_are_values else self._allocate(codec, num_blocks, device, pin)
                for shape, codec, key_store in zip(self.layer_shapes, self.value_codecs, key_stores, strict=True)]

    def _allocate(self, codec: KVCodec, num_blocks: int, device, pin: bool = False) -> dict[str, torch.Tensor]:
        return {name: torch.zeros((num_blocks, self.block_size, *shape), dtype=dtype, device=device,
                                  pin_memory=pin)
                for name, (shape, dtype) in codec.storage().items()}

    def bytes_per_token(self) -> int:
        """Bytes one token occupies in the pool, K and V of every layer (K only where keys are values)."""
        return sum(k.bytes_per_token() + (0 if shape.keys_are_values else v.bytes_per_token())
                   for shape, k, v in zip(self.layer_shapes, self.key_codecs, self.value_codecs, strict=True))

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor | None, slot_mapping: torch.Tensor,
              positions: torch.Tensor | None = None) -> None:
        """Store key/value [T, Hkv, D] of tokens at `positions` [T] in flat slots [T] (block*size+offset);
        a keys-as-values layer stores only the keys (`value` is not read: None or the keys)."""
        sides = [(self.key_codecs[layer], self.key_stores[layer], key)]
        if not self.keys_are_values(layer):
            sides.append((self.value_codecs[layer], self.value_stores[layer], value))
        for codec, store, x in sides:
            for name, encoded in codec.encode(x, positions).items():
                tensor = store[name]
                per_slot = tensor[0, 0].numel()
                tensor.view(-1, per_slot).index_copy_(0, slot_mapping, encoded.reshape(-1, per_slot))

    def gather_blocks(self, layer: int, block_ids: torch.Tensor, scratch: dict[tuple, torch.Tensor] | None = None,
                      first_blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks `block_ids` [S, B] (row i: B logical blocks of a sequence from its logical
        block `first_blocks[i]`, default 0): [S, B * block_size, Hkv, D] each.

        Only the gathered blocks are decoded; a rotated format returns its rotated domain (see
        transform_query / restore_output). Token j of row i is taken to hold position
        first_blocks[i] * block_size + j.

        `scratch`: buffers the caller keeps from one layer to the next (the same blocks are gathered in
        every layer of a step), which the stored blocks are gathered into instead of new tensors; the
        results are views of them, valid until the next call with the same `scratch`. On a CPU whose
        allocator maps every tensor of 1 MiB or more apart (as `localserve serve` did while serving,
        model_loader.map_big_allocations_apart), the page faults of a new gather per layer made a step
        of 8 decodes of 450-640 tokens take 180-200 ms instead of 123-126 ms.
        """
        num_seqs, num_blocks = block_ids.shape
        length = num_blocks * self.block_size
        flat_blocks = block_ids.flatten()
        positions = None
        if self.needs_positions:
            positions = torch.arange(length, device=block_ids.device).repeat(num_seqs)
            if first_blocks is not None:
                positions += (first_blocks * self.block_size).repeat_interleave(length)
        out = []
        for kind, codec, store in (("key", self.key_codecs[layer], self.key_stores[layer]),
                                   ("value", self.value_codecs[layer], self.value_stores[layer])):
            if kind == "value" and self.keys_are_values(layer):  # the same bytes, decoded alike
                out.append(out[0])
                break
            gathered = {name: self._gather(tensor, flat_blocks, scratch, (kind, name))
                        for name, tensor in store.items()}
            decoded = codec.decode(gathered, positions)
            out.append(decoded.view(num_seqs, length, *decoded.shape[1:]))
        return out[0], out[1]

    @staticmethod
    def _gather(tensor: torch.Tensor, flat_blocks: torch.Tensor, scratch: dict[tuple, torch.Tensor] | None,
                key: tuple[str, str]) -> torch.Tensor:
        """The blocks `flat_blocks` of one stored tensor, [N * block_size, ...]: into scratch[key, row shape]
        when given (a new buffer when the block count changed), else into a new tensor. index_select on a
        2-D view (a row per block) is several times faster than advanced indexing."""
        rows = tensor.view(tensor.shape[0], -1)
        if scratch is None:
            return torch.index_select(rows, 0, flat_blocks).view(-1, *tensor.shape[2:])
        key = (*key, rows.shape[1], tensor.dtype)
        out = scratch.get(key)
        if out is None or out.shape[0] != flat_blocks.numel():
            out = scratch[key] = rows.new_empty((flat_blocks.numel(), rows.shape[1]))
        return torch.index_select(rows, 0, flat_blocks, out=out).view(-1, *tensor.shape[2:])

    def transform_query(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """query [T, H, D] into the domain of this layer's gathered keys (identity unless rotated)."""
        return self.key_codecs[layer].transform_query(query)

    def restore_output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        """Attention output [T, H, D] over gathered values back to true values (identity unless rotated)."""
        return self.value_codecs[layer].restore_output(output)

    def _all_tensors(self, key_stores, value_stores) -> list[torch.Tensor]:
        """Every stored tensor once (a keys-as-values layer's value store is its key store)."""
        stores = [*key_stores, *(v for v, k in zip(value_stores, key_stores, strict=True) if v is not k)]
        return [t for store in stores for t in store.values()]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (copy-on-write) in every layer: each (source, destination)."""
        if not pairs:
            return
        device = next(iter(self.key_stores[0].values())).device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for cache in self._all_tensors(self.key_stores, self.value_stores):
            cache[dst] = cache[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks in their stored format to the CPU pool: each (gpu_block, cpu_block), every layer.

        Gathered on the device, copied into host staging buffers, and only once those copies have
        completed scattered into the CPU pool.
        """
        if not pairs:
            return
        stores = self._all_tensors(self.key_stores, self.value_stores)
        src = torch.tensor([gpu for gpu, _ in pairs], device=stores[0].device)
        staged = []
        for store in stores:
            host = self.transfers.host_buffer(store, len(pairs))
            self.transfers.to_host(host, store.index_select(0, src))
            staged.append(host)
        self.transfers.wait()  # the staged bytes are read below: they must have landed
        dst = torch.tensor([cpu for _, cpu in pairs])
        for cpu_store, host in zip(self._all_tensors(self.cpu_key_stores, self.cpu_value_stores), staged, strict=True):
            cpu_store.index_copy_(0, dst, host)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks back from the CPU pool: each (cpu_block, gpu_block), in every layer.

        Gathered on the host into staging buffers, copied to the device and scattered there, all in
        order with the compute stream; the host does not wait.
        """
        if not pairs:
            return
        stores = self._all_tensors(self.key_stores, self.value_stores)
        src = torch.tensor([cpu for cpu, _ in pairs])
        dst = torch.tensor([gpu for _, gpu in pairs], device=stores[0].device)
        for store, cpu_store in zip(stores, self._all_tensors(self.cpu_key_stores, self.cpu_value_stores), strict=True):
            host = self.transfers.host_buffer(cpu_store, len(pairs))
            torch.index_select(cpu_store, 0, src, out=host)
            store.index_copy_(0, dst, self.transfers.to_device(host))
