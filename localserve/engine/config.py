"""Engine and scheduler settings (the CLI's -c, -np, --max-num-batched-tokens, ...). No torch here: a config
is made, and so checked, before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from localserve.attention import check_backend_name
from localserve.kv.formats import KVFormatSpec

PREEMPTION_MODES = ("recompute", "swap")
SPEC_TYPES = ("ngram", "draft")  # speculative decoding's drafters (engine/speculation.py)
# Drafted tokens a step at most, by default: K = 8 gave document Q&A 2.04-2.13x on the dev CPU where K = 4
# gave 1.80-1.99x (docs/BENCHMARKS.md); K adapts per sequence below it, so free text drafts less.
SPEC_TOKENS = 8
# Tokens between two checkpoints of a recurrent state by default (kv/state_steps.py; the last block boundary
# a few tokens before a prompt's end is always one too, kv/state_group.py's PROMPT_TAIL). One default step
# budget (512 tokens): a prefix hit that falls between two checkpoints recomputes at most one step's worth,
# and a prefill step writes at most one checkpoint per sequence besides the running state. Denser checkpoints
# cost memory: one state (a checkpoint or a running state) of Qwen3.6-27B (48 linear layers, 48 value heads
# of 128 x 128 in float32, bf16 convolutions) takes 146.8 MiB, as much as 2,349 tokens of its 16-bit KV; of
# Qwen3.6-35B-A3B (30 layers, 32 heads) 61.4 MiB, 3,144 tokens.
STATE_CHECKPOINT_TOKENS = 512
# Sequences running at once (-np) when none is given; fewer for a model whose recurrent states would take
# more than half the KV memory at this many (engine/builder.py, `fit_state_sequences`).
DEFAULT_MAX_NUM_SEQS = 16
IMAGE_CACHE_BYTES = 256 << 20
"""The image embeddings cache's default bound (engine/multimodal.py): a few hundred images of a 24 GB model's
size (256 rows of 4 KiB)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs of EngineConfig."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # -np/--parallel: sequences running at once (samples and beams count)
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
    # max_num_seqs None: DEFAULT_MAX_NUM_SEQS, which the builder may lower to fit a model's recurrent states
    # (an int after the config is made; `max_num_seqs_given` says whether one was given).
    max_num_seqs: int | None = None
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
    # Speculative decoding (--spec-type, --spec-tokens): None off; "ngram" (prompt lookup) or "draft" (a
    # draft model, given to build_engine); up to spec_tokens drafted tokens a step, fewer as acceptance falls.
    spec_type: str | None = None
    spec_tokens: int = SPEC_TOKENS
    # The step budget in time (--max-step-ms): None off (the library's default: offline generation has no
    # stream to keep steady); "auto": twice a stream's usual gap (engine/step_budget.py); a number of ms.
    max_step_ms: float | str | None = None
    # Models with recurrent (linear-attention) layers (--state-checkpoint-tokens, --state-cache-slots): their
    # state is checkpointed every `state_checkpoint_tokens` tokens of a sequence (a multiple of block_size) and
    # at the last block boundary a few tokens before its prompt's end (kv/state_group.py), for the prefix
    # cache; the state pool holds, besides what the running sequences need, `state_cache_slots` slots for
    # cached checkpoints (None: one per running sequence, so each conversation's last checkpoint can outlive
    # the next max_num_seqs - 1 requests).
    state_checkpoint_tokens: int = STATE_CHECKPOINT_TOKENS
    state_cache_slots: int | None = None
    # The embeddings of recently seen images are kept up to this many bytes (engine/multimodal.py).
    image_cache_bytes: int = IMAGE_CACHE_BYTES
    max_num_seqs_given: bool = field(init=False, default=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.max_num_seqs_given = self.max_num_seqs is not None
        if self.max_num_seqs is None:
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        self.scheduler_config()  # validates the scheduler's fields now, not at the first step
        if self.state_checkpoint_tokens < self.block_size or self.state_checkpoint_tokens % self.block_size:
            raise ValueError(f"state_checkpoint_tokens (--state-checkpoint-tokens) must be a positive multiple of the "
                             f"block size {self.block_size}, got {self.state_checkpoint_tokens}")
        if self.image_cache_bytes < 0:
            raise ValueError(f"image_cache_bytes must be >= 0, got {self.image_cache_bytes}")
        if self.state_cache_slots is not None and self.state_cache_slots < 0:
            raise ValueError(f"state_cache_slots (--state-cache-slots) must be >= 0, got {self.state_cache_slots}")
        if self.spec_type is not None and self.spec_type not in SPEC_TYPES:
            raise ValueError(f"spec_type must be one of {', '.join(SPEC_TYPES)} (or None), got {self.spec_type!r}")
        if self.spec_tokens < 1:
            raise ValueError(f"spec_tokens must be >= 1, got {self.spec_tokens}")
        if self.max_step_ms is not None and self.max_step_ms != "auto" and (
                isinstance(self.max_step_ms, (str, bool)) or not self.max_step_ms > 0):
            raise ValueError(f"max_step_ms must be 'auto', a number of milliseconds > 0, or None, "
                             f"got {self.max_step_ms!r}")
        if isinstance(self.cache_type_k, str):
            self.cache_type_k = KVFormatSpec.parse(self.cache_type_k)
        if isinstance(self.cache_type_v, str):
            self.cache_type_v = KVFormatSpec.parse(self.cache_type_v)
        check_backend_name(self.attention_backend)

    def model_len(self, context_length: int) -> int:
        """The context a model of `context_length` tokens is served with: `max_model_len`, at most its own."""
        return min(self.max_model_len or context_length, context_length)

    @property
    def state_checkpoint_blocks(self) -> int:
        """Blocks between two policy checkpoints of a recurrent state."""
        return self.state_checkpoint_tokens // self.block_size

    @property
    def num_state_cache_slots(self) -> int:
        """State slots kept for cached checkpoints beyond the running sequences' need."""
        return self.max_num_seqs if self.state_cache_slots is None else self.state_cache_slots

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill,
                               self.preemption_mode)
