"""Engine and scheduler settings (the CLI's -c, -np, --max-num-batched-tokens, ...). No torch here: a config
is made, and so checked, before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass

from localserve.attention import check_backend_name
from localserve.kv.formats import KVFormatSpec

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs of EngineConfig."""

    max_num_seqs: int = 16  # -np/--parallel: sequences running at once (samples and beams count)
    max_num_batched_tokens: int = 512  # token budget of one step
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs (every "
                             f"running sequence decodes each step); got {self.max_num_seqs}, "
                             f"{self.max_num_batched_tokens}")


@dataclass
class EngineConfig:
    """Pool, scheduling and attention settings of one engine; every field is checked when the config is made
    (ValueError), a KV format name parsed into its KVFormatSpec then."""

    num_kv_blocks: int = 1024
    block_size: int = 16
    num_cpu_blocks: int = 0  # swap space; defaults to num_kv_blocks in swap mode
    max_model_len: int | None = None  # -c/--ctx-size; None: the model's own context length
    # The scheduler's settings (-np, --max-num-batched-tokens, --enable-chunked-prefill, --preemption-mode).
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    check_integrity: bool = False  # run BlockManager.check_integrity() after every step
    # The K and V formats (-ctk, -ctv): a spec, or a name such as "q8_0" or "q4_rot:-mean" that the config
    # parses into one; None: the model's dtype.
    cache_type_k: KVFormatSpec | str | None = None
    cache_type_v: KVFormatSpec | str | None = None
    # Size the pool from memory instead of num_kv_blocks: a byte budget, or a fraction of the CUDA device.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    attention_backend: str = "auto"  # a name of localserve.attention's registry, or "auto"

    def __post_init__(self) -> None:
        self.scheduler_config()  # validates the scheduler's fields now, not at the first step
        if isinstance(self.cache_type_k, str):
            self.cache_type_k = KVFormatSpec.parse(self.cache_type_k)
        if isinstance(self.cache_type_v, str):
            self.cache_type_v = KVFormatSpec.parse(self.cache_type_v)
        check_backend_name(self.attention_backend)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill,
                               self.preemption_mode)
