"""The paged KV pool: per layer, K and V for `num_blocks` blocks of `block_size` tokens.

The block manager hands out block ids; this module owns the bytes behind them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from localserve.kv.block_pool import BlockMove
from localserve.kv.calibration import KVCalibration
from localserve.kv.codecs import KVCodec, RopeFn, dtype_format, make_codec
from localserve.kv.formats import KVFormatSpec
from localserve.kv.recurrent_states import RecurrentStateCache


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

    Layer groups (kv/layer_groups.py): layer i belongs to group `layer_groups[i]`, whose pool has
    `group_num_blocks[group]` blocks (each group is its own block id space); default: one group of
    `num_blocks`. Block moves name their group: (source, destination, group), and touch only its layers.
    `layer_shapes`: one `LayerKVShape` per layer where layers differ (KV heads, head size, keys as
    values); None: every layer `num_kv_heads` x `head_dim` with its own values.

    `states`: the slots of a state group (kv/recurrent_states.py), for a model with recurrent layers. Those
    layers (`states.layers`) keep no K or V here (their stores are empty); they form the last group, whose
    "blocks" are the states' slots, and its block moves copy and swap slots there.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", num_cpu_blocks: int = 0,
                 key_format: KVFormatSpec | None = None, value_format: KVFormatSpec | None = None,
                 calibration: KVCalibration | None = None, rope: RopeFn | None = None,
                 layer_shapes: Sequence[LayerKVShape] | None = None, layer_groups: Sequence[int] | None = None,
                 group_num_blocks: Sequence[int] | None = None, states: RecurrentStateCache | None = None) -> None:
        self.layer_groups = list(layer_groups) if layer_groups is not None else [0] * num_layers
        self.group_num_blocks = list(group_num_blocks) if group_num_blocks is not None else [num_blocks]
        if len(self.layer_groups) != num_layers or not set(self.layer_groups) <= set(range(len(self.group_num_blocks))):
            raise ValueError(f"layer groups {self.layer_groups} do not match {num_layers} layers and "
                             f"{len(self.group_num_blocks)} groups")
        self.states = states
        self.state_group = self._state_group(states)
        self.num_blocks = self.group_num_blocks[0]
        self.block_size = block_size
        self.device = torch.device(device)
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
        layer_blocks = [self.group_num_blocks[group] for group in self.layer_groups]
        self.key_stores = [self._allocate(c, n, device, layer=i)
                           for i, (c, n) in enumerate(zip(self.key_codecs, layer_blocks, strict=True))]
        self.value_stores = self._value_stores(self.key_stores, layer_blocks, device)
        # The swap space: the same layout in CPU memory (pinned when the pool is on a GPU).
        self.cpu_key_stores = [self._allocate(c, num_cpu_blocks, "cpu", pin, layer=i)
                               for i, c in enumerate(self.key_codecs)]
        self.cpu_value_stores = self._value_stores(self.cpu_key_stores, [num_cpu_blocks] * num_layers, "cpu", pin)

    def _state_group(self, states: RecurrentStateCache | None) -> int | None:
        """The group of `states`' layers, checked: those layers and no other, the last group, one block per slot."""
        if states is None:
            return None
        groups = {self.layer_groups[layer] for layer in states.layers if 0 <= layer < len(self.layer_groups)}
        last = len(self.group_num_blocks) - 1
        members = tuple(layer for layer, group in enumerate(self.layer_groups) if group == last)
        if groups != {last} or members != states.layers:
            raise ValueError(f"the recurrent layers {list(states.layers)} must form the last layer group alone; "
                             f"layer groups are {self.layer_groups}")
        if self.group_num_blocks[last] != states.num_slots:
            raise ValueError(f"the state group has {self.group_num_blocks[last]} blocks but its cache "
                             f"{states.num_slots} slots")
        return last

    def is_recurrent(self, layer: int) -> bool:
        """Whether `layer` keeps a recurrent state (in `states`) instead of K and V."""
        return self.state_group is not None and self.layer_groups[layer] == self.state_group

    def keys_are_values(self, layer: int) -> bool:
        """Whether `layer` keeps no value store (its value store is its key store)."""
        return self.layer_shapes[layer].keys_are_values

    def _value_stores(self, key_stores: list[dict[str, torch.Tensor]], layer_blocks: Sequence[int], device,
                      pin: bool = False) -> list[dict[str, torch.Tensor]]:
        """Each layer's value store of `layer_blocks[layer]` blocks: its key store itself where its keys are its
        values."""
        return [key_store if shape.keys_are_values else self._allocate(codec, num_blocks, device, pin, layer)
                for layer, (shape, codec, key_store, num_blocks) in enumerate(
                    zip(self.layer_shapes, self.value_codecs, key_stores, layer_blocks, strict=True))]

    def _allocate(self, codec: KVCodec, num_blocks: int, device, pin: bool = False,
                  layer: int | None = None) -> dict[str, torch.Tensor]:
        """A store of `num_blocks` blocks in `codec`'s layout; none (an empty dict) for a recurrent layer."""
        if layer is not None and self.is_recurrent(layer):
            return {}
        return {name: torch.zeros((num_blocks, self.block_size, *shape), dtype=dtype, device=device,
                                  pin_memory=pin)
                for name, (shape, dtype) in codec.storage().items()}

    def group_bytes_per_token(self) -> list[int]:
        """Bytes one token occupies in each layer group's layers, K and V (K only where keys are values)."""
        per_group = [0] * len(self.group_num_blocks)
        for layer in range(len(self.layer_shapes)):
            per_group[self.layer_groups[layer]] += self._layer_bytes_per_token(layer)
        return per_group

    def bytes_per_token(self) -> int:
        """Bytes one token occupies in the pool, K and V of every layer (K only where keys are values; nothing
        in a recurrent layer: its state does not grow with tokens, `state_bytes`)."""
        return sum(map(self._layer_bytes_per_token, range(len(self.layer_shapes))))

    def _layer_bytes_per_token(self, layer: int) -> int:
        if self.is_recurrent(layer):
            return 0
        value_bytes = 0 if self.keys_are_values(layer) else self.value_codecs[layer].bytes_per_token()
        return self.key_codecs[layer].bytes_per_token() + value_bytes

    def state_bytes(self) -> int:
        """Bytes of the state group's slots on the device (0 without one)."""
        return 0 if self.states is None else self.states.num_slots * self.states.slot_bytes

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

    def _group_tensors(self, key_stores, value_stores, group: int) -> list[torch.Tensor]:
        """Every stored tensor of the group's layers once, K then V (a keys-as-values layer's value store is
        its key store)."""
        layers = [layer for layer, layer_group in enumerate(self.layer_groups) if layer_group == group]
        stores = [key_stores[layer] for layer in layers]
        stores += [value_stores[layer] for layer in layers if value_stores[layer] is not key_stores[layer]]
        return [t for store in stores for t in store.values()]

    def _state_moves(self, moves: Sequence[BlockMove]) -> tuple[list[BlockMove], list[BlockMove]]:
        """The moves of K/V blocks, and those of the state group's slots."""
        if self.state_group is None:
            return list(moves), []
        kv_moves = [move for move in moves if move[2] != self.state_group]
        return kv_moves, [move for move in moves if move[2] == self.state_group]

    def _by_group(self, moves: Sequence[BlockMove]) -> dict[int, tuple[list[int], list[int]]]:
        """The moves' sources and destinations, by group."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for source, destination, group in moves:
            sources, destinations = by_group.setdefault(group, ([], []))
            sources.append(source)
            destinations.append(destination)
        return by_group

    def copy_blocks(self, moves: Sequence[BlockMove]) -> None:
        """Copy whole blocks (copy-on-write) in every layer of their group: each (source, destination, group);
        the state group's are slots of `states`."""
        moves, state_moves = self._state_moves(moves)
        if state_moves:
            self.states.copy_slots(state_moves)
        for group, (sources, destinations) in self._by_group(moves).items():
            src = torch.tensor(sources, device=self.device)
            dst = torch.tensor(destinations, device=self.device)
            for cache in self._group_tensors(self.key_stores, self.value_stores, group):
                cache[dst] = cache[src]

    def swap_out(self, moves: Sequence[BlockMove]) -> None:
        """Copy blocks in their stored format to the CPU pool: each (gpu_block, cpu_block, group), every layer
        of the group.

        Gathered on the device, copied into host staging buffers, and only once those copies have
        completed scattered into the CPU pool. The state group's moves copy slots of `states`.
        """
        moves, state_moves = self._state_moves(moves)
        if state_moves:
            self.states.swap_out(state_moves)
        by_group = self._by_group(moves)
        staged = {}
        for group, (sources, _) in by_group.items():
            stores = self._group_tensors(self.key_stores, self.value_stores, group)
            src = torch.tensor(sources, device=stores[0].device)
            staged[group] = []
            for store in stores:
                host = self.transfers.host_buffer(store, len(sources))
                self.transfers.to_host(host, store.index_select(0, src))
                staged[group].append(host)
        if not staged:
            return
        self.transfers.wait()  # the staged bytes are read below: they must have landed
        for group, (_, destinations) in by_group.items():
            dst = torch.tensor(destinations)
            cpu_stores = self._group_tensors(self.cpu_key_stores, self.cpu_value_stores, group)
            for cpu_store, host in zip(cpu_stores, staged[group], strict=True):
                cpu_store.index_copy_(0, dst, host)

    def swap_in(self, moves: Sequence[BlockMove]) -> None:
        """Copy blocks back from the CPU pool: each (cpu_block, gpu_block, group), in every layer of the group.

        Gathered on the host into staging buffers, copied to the device and scattered there, all in
        order with the compute stream; the host does not wait. The state group's moves copy slots of `states`.
        """
        moves, state_moves = self._state_moves(moves)
        if state_moves:
            self.states.swap_in(state_moves)
        for group, (sources, destinations) in self._by_group(moves).items():
            stores = self._group_tensors(self.key_stores, self.value_stores, group)
            cpu_stores = self._group_tensors(self.cpu_key_stores, self.cpu_value_stores, group)
            src = torch.tensor(sources)
            dst = torch.tensor(destinations, device=stores[0].device)
            for store, cpu_store in zip(stores, cpu_stores, strict=True):
                host = self.transfers.host_buffer(cpu_store, len(sources))
                torch.index_select(cpu_store, 0, src, out=host)
                store.index_copy_(0, dst, self.transfers.to_device(host))
