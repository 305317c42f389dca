"""Memory planning: KV bytes per token per format, blocks that fit a budget, and `localserve plan`'s table.
No torch here.

Everything is computed from the model's real shapes (each layer's KV heads and head size, whether its
keys are its values, its sliding window) and each format's exact storage layout, so the plan and the
pool the engine allocates agree byte for byte. Where layers have sliding windows, each layer group gets
its own pool (kv/group_plan.py): the window pools are bounded, and "tokens that fit" counts the full
group's pool, what the rest of the budget holds. Where layers are recurrent (Gated DeltaNet), their
states take a pool of slots off the budget first (kv/group_plan.py); the KV of the attention layers gets
the rest. Sizes such as `24GB` are read as binary units (GiB): that is what a "24 GB" card has.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from localserve.kv.formats import KVFormatSpec
from localserve.kv.group_plan import GroupPool, LayeredShape, layer_bytes_per_token, plan_group_pools

DEFAULT_UTILIZATION = 0.9
PLAN_FORMATS = tuple((KVFormatSpec.parse(k), KVFormatSpec.parse(v))
                     for k, v in (("fp16", "fp16"), ("q8_0", "q8_0"), ("q8_0", "q4_rot"), ("q4_rot", "q4_rot")))
CONTEXTS = (8192, 32768)
_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


def uncalibrated(spec: KVFormatSpec) -> KVFormatSpec:
    """The format without the model's calibrated statistics (the same bytes): what a model whose layers the
    calibration cannot run (recurrent layers) stores."""
    if not spec.needs_calibration:
        return spec
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, mean=False, key_transform=False))


def parse_size(text: str) -> int:
    """'24GB', '24GiB', '24g', '512MB', '1e9' -> bytes (K/M/G/T are binary multiples)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 24GB, 8GiB, 512MB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class KVShape(LayeredShape):
    """The shape numbers of a model that size its KV pool (a ModelConfig has them)."""

    context_length: int


def kv_bytes_per_token(shape: LayeredShape, key_format: KVFormatSpec, value_format: KVFormatSpec) -> int:
    """Bytes one token's K and V take in the pool, all layers; raises ValueError when a format cannot
    store the model's head vectors."""
    return sum(layer_bytes_per_token(shape.attention_of(layer), key_format, value_format)
               for layer in range(shape.num_layers))


def num_kv_blocks(kv_budget_bytes: int, bytes_per_token: int, block_size: int = 16) -> int:
    """Whole blocks of `block_size` tokens that fit in `kv_budget_bytes`."""
    return max(0, kv_budget_bytes // (bytes_per_token * block_size))


def kv_budget_bytes(total_memory: int, weight_bytes: int, utilization: float = DEFAULT_UTILIZATION,
                    reserve_bytes: int = 0) -> int:
    """What is left for the KV pool: `utilization` of the device, less weights and a reserve."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    return max(0, int(total_memory * utilization) - weight_bytes - reserve_bytes)


def blocks_for_device(shape: KVShape, key_format: KVFormatSpec, value_format: KVFormatSpec, block_size: int,
                      weight_bytes: int, total_memory: int | None = None,
                      utilization: float = DEFAULT_UTILIZATION, kv_budget: int | None = None,
                      reserve_bytes: int = 0) -> int:
    """Number of KV blocks from an explicit byte budget, else from the device memory and utilization."""
    if kv_budget is None:
        if total_memory is None:
            raise ValueError("give either a KV byte budget or the device memory")
        kv_budget = kv_budget_bytes(total_memory, weight_bytes, utilization, reserve_bytes)
    return num_kv_blocks(kv_budget, kv_bytes_per_token(shape, key_format, value_format), block_size)


@dataclass
class PlanRow:
    """One line of the plan: a K/V format pair and what fits."""

    key_format: KVFormatSpec
    value_format: KVFormatSpec
    bits_k: float
    bits_v: float
    bytes_per_token: int  # every layer's
    tokens: int  # whole blocks' worth (with window groups: the full group's pool)
    sequences: dict[int, int]  # context length -> sequences that fit at that length
    window_pools: tuple[GroupPool, ...] = ()  # with a full group beside window groups: theirs
    tokens_without_windows: int = 0  # what would fit if every layer kept every token
    state_pool: GroupPool | None = None  # the recurrent layers' state slots, off the budget first

    @property
    def label(self) -> str:
        if self.key_format == self.value_format:
            return str(self.key_format)
        return f"K {self.key_format} / V {self.value_format}"


def plan(shape: KVShape, kv_budget: int, block_size: int = 16,
         formats: tuple[tuple[KVFormatSpec, KVFormatSpec], ...] = PLAN_FORMATS,
         contexts: tuple[int, ...] = CONTEXTS, max_num_seqs: int = 16, max_model_len: int | None = None,
         chunk_tokens: int | None = 512, state_checkpoint_blocks: int = 32, state_cache_slots: int | None = None,
         state_conv_bytes: int = 2) -> list[PlanRow]:
    """What fits in `kv_budget` bytes of KV pool for each (K format, V format). Window groups' pools are
    sized for `max_num_seqs` slots, prefill chunks of `chunk_tokens` (None: no chunked prefill) and prompts of
    `max_model_len` tokens (None: the model's context); a state group's pool for `max_num_seqs` sequences, a
    checkpoint every `state_checkpoint_blocks` blocks and `state_cache_slots` cached checkpoints (None: one
    per sequence, the engine's default): kv/group_plan.py. Raises ValueError when the budget cannot hold the
    state pool."""
    rows = []
    cache_slots = max_num_seqs if state_cache_slots is None else state_cache_slots
    for key_format, value_format in formats:
        per_token = kv_bytes_per_token(shape, key_format, value_format)
        pools = plan_group_pools(shape, key_format, value_format, kv_budget, block_size, max_num_seqs,
                                 max_model_len or shape.context_length, chunk_tokens, state_checkpoint_blocks,
                                 cache_slots, state_conv_bytes)
        state_pool = pools.pop() if pools[-1].group.recurrent else None
        kv_left = kv_budget - (state_pool.pool_bytes(block_size) if state_pool else 0)
        tokens_without_windows = num_kv_blocks(kv_left, per_token, block_size) * block_size if per_token else 0
        has_window_pools = pools[0].group.sliding_window is None and len(pools) > 1
        tokens = pools[0].num_blocks * block_size if has_window_pools else tokens_without_windows
        seqs = {ctx: tokens // ctx for ctx in contexts}
        rows.append(PlanRow(key_format, value_format, key_format.bits_per_value(shape.head_dim),
                            value_format.bits_per_value(shape.head_dim), per_token, tokens, seqs,
                            tuple(pools[1:]) if has_window_pools else (), tokens_without_windows, state_pool))
    return rows


def describe_state_pool(shape: KVShape, row: PlanRow, kv_budget: int, block_size: int = 16) -> str:
    """One line on a plan's recurrent states: the size of one state (and in tokens of the row's KV), the
    pool's slots and bytes, and its share of the budget beside the KV's."""
    pool = row.state_pool
    state_bytes = pool.pool_bytes(block_size)
    kv_bytes = kv_budget - state_bytes
    as_tokens = f" = {pool.slot_bytes // row.bytes_per_token:,} tokens of {row.label} KV" if row.bytes_per_token else ""
    return (f"recurrent states ({len(pool.group.layers)} of {shape.num_layers} layers): one state (a running "
            f"sequence or a checkpoint) {human_size(pool.slot_bytes)}{as_tokens}; state pool {pool.num_blocks:,} "
            f"slots = {human_size(state_bytes)} ({state_bytes / max(kv_budget, 1):.0%} of the pool), KV of the "
            f"{shape.num_layers - len(pool.group.layers)} attention layers {human_size(kv_bytes)} "
            f"({kv_bytes / max(kv_budget, 1):.0%})")


def human_size(n: float) -> str:
    """Bytes in binary units: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_plan(rows: list[PlanRow], contexts: tuple[int, ...] = CONTEXTS, block_size: int = 16) -> str:
    """The plan as a Markdown table (like DESIGN.md section 3); with window groups, what fits without
    them and each window pool (blocks and bytes) besides."""
    base = rows[0].tokens or 1
    windows = any(row.window_pools for row in rows)
    header = ["format", "bits/value (K, V)", "bytes/token", "tokens that fit", "vs first row"]
    header += [f"seqs @ {c // 1024}K" for c in contexts]
    header += ["without windows", "window pools"] if windows else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row.label, f"{row.bits_k:g}, {row.bits_v:g}",
                 f"{row.bytes_per_token:,} ({human_size(row.bytes_per_token)})", f"{row.tokens:,}",
                 f"{row.tokens / base:.2f}x"]
        cells += [str(row.sequences[c]) for c in contexts]
        if windows:
            cells += [f"{row.tokens_without_windows:,}", "; ".join(
                f"{pool.label} ({len(pool.group.layers)} layers): {pool.num_blocks:,} blocks, "
                f"{human_size(pool.num_blocks * block_size * pool.bytes_per_token)}" for pool in row.window_pools)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
