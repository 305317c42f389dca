"""What does not change while an engine runs, as one typed record (no torch here): the context length,
the KV pool's shape and formats, the scheduler's budgets, what the pool's memory would hold in each
KV format.

`read_facts` is the one place that reads these off an `LLMEngine`; the server (its routes, the
monitor's hello frame) reads this record instead of the engine, through the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from localserve.kv.formats import KVFormatSpec
from localserve.kv.memory_plan import kv_bytes_per_token

if TYPE_CHECKING:
    from localserve.engine.engine import LLMEngine

# the formats whose capacity the monitor shows
CAPACITY_FORMATS = tuple(KVFormatSpec.parse(name) for name in ("fp16", "q8_0", "q4_rot"))


@dataclass(frozen=True)
class KvCapacity:
    """How many tokens the pool's memory would hold with K and V both in `format`."""

    format: str
    bytes_per_token: int
    num_tokens: int


@dataclass(frozen=True)
class KvGroupFacts:
    """One layer group's pool (kv/layer_groups.py): "full", "window W" or "state", its layers and blocks (a
    state group's blocks are its slots, each one recurrent state of its layers)."""

    label: str
    num_layers: int
    num_blocks: int
    bytes_per_token: int  # K and V of its layers, in the pool's formats (0 in a state group)
    slot_bytes: int = 0  # a state group's: one slot's state over its layers


@dataclass(frozen=True)
class EmbeddingFacts:
    """What an embedding model's vectors are: its pooling ("last", "mean", "cls"), whether they are
    L2-normalised, their size, and whether a client may ask for fewer `dimensions` (Matryoshka)."""

    pooling: str
    normalized: bool
    dimensions: int
    truncatable: bool


@dataclass(frozen=True)
class EngineFacts:
    """An engine's fixed settings and sizes."""

    max_model_len: int  # tokens of prompt plus output one request may hold
    vocab_size: int
    block_size: int  # tokens per KV block
    num_gpu_blocks: int  # every layer group's pool, group after group
    num_cpu_blocks: int  # the swap pool (0: none)
    max_num_seqs: int  # sequences running at once: the parallel slots
    max_num_batched_tokens: int  # tokens one step computes at most
    cache_type_k: str
    cache_type_v: str
    kv_bytes_per_token: int  # K and V of every layer, in the pool's formats
    capacity: tuple[KvCapacity, ...]  # per format of CAPACITY_FORMATS that fits the model's head size
    embedding: EmbeddingFacts | None = None  # an embedding model's (None: a generation model)
    kv_groups: tuple[KvGroupFacts, ...] = ()  # with layer groups, their pools, group 0 first (empty: one pool)

    @property
    def kv_cache_bytes(self) -> int:
        """The GPU pool's size in bytes (every group's)."""
        if self.kv_groups:
            return sum(group.num_blocks * (self.block_size * group.bytes_per_token + group.slot_bytes)
                       for group in self.kv_groups)
        return self.num_gpu_blocks * self.block_size * self.kv_bytes_per_token


def read_facts(engine: LLMEngine) -> EngineFacts:
    """The facts of `engine` (any thread: it reads settings fixed when the engine was built)."""
    config, kv_cache, model_config = engine.config, engine.runner.kv_cache, engine.model_config
    scheduler_config = engine.scheduler.config
    bytes_per_token = kv_cache.bytes_per_token()
    group_bytes = kv_cache.group_bytes_per_token()
    pool_bytes = config.block_size * sum(num_blocks * per_token for num_blocks, per_token in zip(
        kv_cache.group_num_blocks, group_bytes, strict=True))
    capacity = []
    for spec in CAPACITY_FORMATS:
        try:
            per_token = kv_bytes_per_token(model_config, spec, spec)
        except ValueError:  # the format does not fit this model's head size
            continue
        capacity.append(KvCapacity(str(spec), per_token, pool_bytes // per_token))
    pooling = model_config.pooling
    embedding = None if pooling is None else EmbeddingFacts(pooling.method.value, pooling.normalize,
                                                            model_config.hidden_size, pooling.truncatable)
    return EngineFacts(
        max_model_len=engine.max_model_len, vocab_size=model_config.vocab_size, block_size=config.block_size,
        num_gpu_blocks=engine.block_manager.num_blocks, num_cpu_blocks=engine.block_manager.num_cpu_blocks,
        max_num_seqs=scheduler_config.max_num_seqs, max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        cache_type_k=str(kv_cache.key_format), cache_type_v=str(kv_cache.value_format),
        kv_bytes_per_token=bytes_per_token, capacity=tuple(capacity), embedding=embedding,
        kv_groups=tuple(KvGroupFacts(usage.label, kv_cache.layer_groups.count(group), usage.num_blocks,
                                     group_bytes[group], kv_cache.states.slot_bytes
                                     if group == kv_cache.state_group else 0)
                        for group, usage in enumerate(engine.block_manager.group_usage())) if len(group_bytes) > 1
        else ())
