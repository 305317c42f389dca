"""Putting an engine together for a loaded model: the attention backend chosen, the KV pool sized and
allocated (with the 4-bit format's calibration when a format needs it), the block manager, the scheduler
and the model runner built, and handed to `LLMEngine`, which only runs them."""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from localserve.attention import select_backend
from localserve.engine.config import EngineConfig
from localserve.engine.draft_model import DraftModelDrafter
from localserve.engine.drafting import Drafter
from localserve.engine.engine import LLMEngine
from localserve.engine.events import EventLog
from localserve.engine.kv_calibration import load_or_calibrate
from localserve.engine.model_runner import ModelRunner
from localserve.engine.ngram_drafter import NgramDrafter
from localserve.engine.scheduler import Scheduler
from localserve.engine.speculation import Speculation
from localserve.engine.step_budget import StepCostModel, StepTimeBudget
from localserve.kv.block_manager import BlockManager
from localserve.kv.cache import LayerKVShape, PagedKVCache
from localserve.kv.codecs import dtype_format
from localserve.kv.formats import KVFormatSpec
from localserve.kv.group_plan import (
    STATE_POOL_SHARE,
    GroupPool,
    fit_state_sequences,
    plan_group_pools,
    state_pool_slots,
    state_slot_bytes,
    window_pool_blocks,
)
from localserve.kv.memory_plan import human_size, kv_budget_bytes
from localserve.kv.recurrent_states import RecurrentStateCache
from localserve.models.config import ModelConfig
from localserve.models.protocol import CausalLM

log = logging.getLogger(__name__)


def build_engine(model: CausalLM, tokenizer=None, config: EngineConfig | None = None,
                 draft_model: CausalLM | None = None) -> LLMEngine:
    """An engine for `model` with `config`'s pool, scheduling, attention and speculation settings;
    `draft_model` drafts when `config.spec_type` is "draft" (its tokenizer the target's: checked by the
    caller that loads both, `localserve.llm.check_same_tokenizer`).

    Raises ValueError when the backend asked for cannot run here with these formats, the pool's memory
    budget holds no block, the draft model is missing, has another vocabulary or has recurrent layers; all
    before the pool is allocated.
    """
    config = config or EngineConfig()
    if draft_model is not None and config.spec_type == "draft":  # a draft model drafts with a plain KV pool
        check_draft_model(draft_model.config)
    if config.spec_type == "draft" and draft_model is None:
        raise ValueError("--spec-type draft needs a draft model (-md/--model-draft)")
    if draft_model is not None and draft_model.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft_model.config.vocab_size} tokens, the "
                         f"model's {model.config.vocab_size}: a draft model must share the model's tokenizer")
    param = next(model.parameters())
    model_config = model.config
    key_format = config.cache_type_k or dtype_format(param.dtype)
    value_format = config.cache_type_v or dtype_format(param.dtype)
    backend, why = select_backend(config.attention_backend, param.device, key_format, value_format,
                                  model_config.head_dim, model.attention_geometry())
    log.info("attention backend: %s", why)
    max_model_len = config.model_len(model_config.context_length)
    config = fit_sequences_to_states(model, config, max_model_len)
    pools = group_pools(model, key_format, value_format, config, max_model_len)
    config = dataclasses.replace(config, num_kv_blocks=pools[0].num_blocks)
    if len(pools) > 1:
        log.info("KV layer groups: %s", "; ".join(f"{pool.label}: {len(pool.group.layers)} layers, "
                                                  f"{pool.num_blocks} blocks" for pool in pools))
    scheduler_config = config.scheduler_config()
    num_cpu_blocks = config.num_cpu_blocks or (
        config.num_kv_blocks if scheduler_config.preemption_mode == "swap" else 0)
    kv_cache = build_kv_cache(model, tokenizer, key_format, value_format, config.num_kv_blocks, config.block_size,
                              num_cpu_blocks, pools)
    if kv_cache.states is not None:
        log.info("recurrent states: %d slots of %s (%s), a checkpoint every %d tokens", kv_cache.states.num_slots,
                 human_size(kv_cache.states.slot_bytes), human_size(kv_cache.state_bytes()),
                 config.state_checkpoint_tokens)
    block_manager = BlockManager([pool.num_blocks for pool in pools], config.block_size,
                                 swap_pool_sizes(pools, num_cpu_blocks), config.enable_prefix_caching,
                                 [pool.group.group_window for pool in pools], window_chunk_tokens(config),
                                 config.state_checkpoint_blocks)
    events = EventLog()
    step_cost = StepCostModel() if config.spec_type or config.max_step_ms is not None else None
    step_budget = None
    if config.max_step_ms is not None:
        step_budget = StepTimeBudget(step_cost, None if config.max_step_ms == "auto" else config.max_step_ms / 1000,
                                     min_prefill_tokens=config.block_size)
    speculation = None
    if config.spec_type:
        drafter: Drafter = NgramDrafter() if config.spec_type == "ngram" else build_draft_drafter(draft_model, config)
        speculation = Speculation(drafter, config.spec_tokens, block_manager, config.max_num_seqs, step_cost, events)
    runner = ModelRunner(model, kv_cache, backend, max_model_len, config.image_cache_bytes)
    scheduler = Scheduler(scheduler_config, block_manager, events, speculation=speculation, step_budget=step_budget,
                          step_cost=step_cost, image_cached=runner.image_embeds.__contains__)
    return LLMEngine(config, runner, block_manager, scheduler, events, tokenizer, max_model_len=max_model_len)


def check_draft_model(model_config: ModelConfig) -> None:
    """Refuse a draft model with recurrent (linear-attention) layers: it drafts over a plain KV pool of its
    own, without states. (A target with such layers verifies drafts exactly: the model runner writes the
    states of its kept tokens only, after the verification.)"""
    if model_config.recurrent_layers:
        raise ValueError(f"{model_config.name} has recurrent (linear-attention) layers "
                         f"{list(model_config.recurrent_layers)}: it cannot be the draft model (--spec-type draft / "
                         "-md), which drafts over a plain KV pool; use a draft model of attention layers only, or "
                         "--spec-type ngram")


def build_draft_drafter(draft_model: CausalLM, config: EngineConfig) -> DraftModelDrafter:
    """The draft model's drafter over a pool of its own (engine/draft_model.py says why): as many blocks as
    the target's pool, in the draft model's dtype, with the same backend choice."""
    param = next(draft_model.parameters())
    kv_format = dtype_format(param.dtype)
    backend, why = select_backend(config.attention_backend, param.device, kv_format, kv_format,
                                  draft_model.config.head_dim)
    log.info("draft model's attention backend: %s", why)
    kv_cache = build_kv_cache(draft_model, None, kv_format, kv_format, config.num_kv_blocks, config.block_size)
    log.info("draft model's KV pool: %d blocks, %s", config.num_kv_blocks,
             human_size(config.num_kv_blocks * config.block_size * kv_cache.bytes_per_token()))
    return DraftModelDrafter(ModelRunner(draft_model, kv_cache, backend),
                             BlockManager(config.num_kv_blocks, config.block_size, 0, enable_prefix_caching=True))


def build_kv_cache(model: CausalLM, tokenizer, key_format: KVFormatSpec, value_format: KVFormatSpec,
                   num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                   pools: list[GroupPool] | None = None) -> PagedKVCache:
    """The paged pool for `model`'s K and V in these formats, on the model's device, each layer in its
    group's pool (`pools`; None: one pool of `num_blocks`) and of its own shape; a format that needs the
    model's calibration gets it (computed once per model and machine) with the model's RoPE."""
    param = next(model.parameters())
    model_config = model.config
    calibration = rope = None
    layer_shapes = layer_kv_shapes(model_config)
    if (key_format.needs_calibration or value_format.needs_calibration) and model_config.recurrent_layers:
        raise ValueError(f"the calibrated KV formats ({key_format} / {value_format}) calibrate over every layer's "
                         f"keys; {model_config.name}'s layers {list(model_config.recurrent_layers)} are recurrent "
                         "(use q8_0 or q4_rot:-mean,-key_transform)")
    if key_format.needs_calibration or value_format.needs_calibration:
        own = next((i for i, layer in enumerate(model_config.layer_attention)
                    if (layer.num_kv_heads, layer.head_dim, layer.keys_are_values, layer.rope, layer.rotary_dim)
                    != (model_config.num_kv_heads, model_config.head_dim, False, None, model_config.rotary_dim)), None)
        if own is not None:
            raise ValueError(f"the calibrated KV formats ({key_format} / {value_format}) calibrate one layer shape "
                             f"and rotary embedding; layer {own} has its own (use q8_0 or "
                             "q4_rot:-mean,-key_transform)")
        if model_config.rotary_dim not in (None, model_config.head_dim):
            raise ValueError(f"the calibrated KV formats ({key_format} / {value_format}) need the rotary embedding "
                             f"over whole heads; this model turns {model_config.rotary_dim} of {model_config.head_dim}")
        calibration = load_or_calibrate(model, tokenizer)
        rope = lambda positions: model.rotary(positions, torch.float32)  # noqa: E731
    layer_groups = group_numbers = states = None
    if pools is not None and len(pools) > 1:
        group_of = {layer: index for index, pool in enumerate(pools) for layer in pool.group.layers}
        layer_groups = [group_of[layer] for layer in range(model_config.num_layers)]
        group_numbers = [pool.num_blocks for pool in pools]
        states = build_state_cache(model_config, pools[-1], param.dtype, param.device,
                                   swap_pool_sizes(pools, num_cpu_blocks)[-1])
    return PagedKVCache(model_config.num_layers, num_blocks, block_size, model_config.num_kv_heads,
                        model_config.head_dim, param.dtype, param.device, num_cpu_blocks, key_format, value_format,
                        calibration, rope, layer_shapes, layer_groups, group_numbers, states)


def build_state_cache(model_config: ModelConfig, pool: GroupPool, dtype: torch.dtype, device: torch.device,
                      num_cpu_slots: int) -> RecurrentStateCache | None:
    """The slots of `pool` when it is the state group (its layers' states, convolution inputs in `dtype`,
    matrices in float32), with `num_cpu_slots` swap slots (`swap_pool_sizes`); None for another group.
    Raises ValueError when the recurrent layers' states differ."""
    if not pool.group.recurrent:
        return None
    shapes = {model_config.attention_of(layer).state for layer in pool.group.layers}
    if len(shapes) != 1:
        raise ValueError(f"the recurrent layers of {model_config.name} keep states of different shapes: {shapes}")
    return RecurrentStateCache(pool.group.layers, shapes.pop(), pool.num_blocks, dtype, device,
                               num_cpu_slots=num_cpu_slots)


def swap_pool_sizes(pools: list[GroupPool], num_cpu_blocks: int) -> list[int]:
    """Each group's swap pool: `num_cpu_blocks` blocks, but a state group's at most as many slots as its GPU
    pool (a state is a whole slot, 60-150 MiB on Qwen3.6 models: a swap pool as large as the KV's would not
    fit in host memory; a swap that does not fit falls back to recompute, engine/preemption.py)."""
    return [min(num_cpu_blocks, pool.num_blocks) if pool.group.recurrent else num_cpu_blocks for pool in pools]


def layer_kv_shapes(config: ModelConfig) -> list[LayerKVShape] | None:
    """Each layer's KV heads, head size and keys-as-values where layers differ (`layer_attention`); else None."""
    if not config.layer_attention:
        return None
    return [LayerKVShape(shape.num_kv_heads, shape.head_dim, shape.keys_are_values)
            for shape in config.layer_attention]


def window_chunk_tokens(config: EngineConfig) -> int | None:
    """The tokens a window group gives a sequence slots for at a time: a step's budget with chunked prefill."""
    return config.max_num_batched_tokens if config.enable_chunked_prefill else None


def kv_budget(model: CausalLM, config: EngineConfig) -> int | None:
    """The pool's byte budget: `config`'s, else its fraction of the CUDA device less what is already allocated
    there (the weights); None: no budget (`num_kv_blocks` sizes the pool)."""
    device = next(model.parameters()).device
    budget = config.kv_cache_memory_bytes
    if budget is None and config.gpu_memory_utilization:
        if device.type != "cuda":
            raise ValueError("--gpu-memory-utilization needs a CUDA device; give a KV budget in bytes instead")
        budget = kv_budget_bytes(torch.cuda.get_device_properties(device).total_memory,
                                 torch.cuda.memory_allocated(device), config.gpu_memory_utilization)
    return budget


def fit_sequences_to_states(model: CausalLM, config: EngineConfig, max_model_len: int) -> EngineConfig:
    """`config` with fewer sequences (and so fewer default state cache slots) where max_num_seqs was not given
    and the state pool of a model with recurrent layers would take more than `STATE_POOL_SHARE` of the KV
    budget at the default (kv/group_plan.py, `fit_state_sequences`), logged in one line; else `config`. A
    given max_num_seqs stays: `plan_group_pools` refuses a state pool over the whole budget, naming by how
    much and what to lower."""
    model_config = model.config
    if config.max_num_seqs_given or not model_config.recurrent_layers:
        return config
    budget = kv_budget(model, config)
    if budget is None:
        return config
    slot_bytes = state_slot_bytes(model_config, tuple(model_config.recurrent_layers),
                                  next(model.parameters()).dtype.itemsize)
    chunk_tokens = window_chunk_tokens(config)
    num_seqs = fit_state_sequences(slot_bytes, budget, config.block_size, config.max_num_seqs, max_model_len,
                                   chunk_tokens, config.state_checkpoint_blocks, config.state_cache_slots)
    if num_seqs == config.max_num_seqs:
        return config
    fitted = dataclasses.replace(config, max_num_seqs=num_seqs)
    default_slots, num_slots = (state_pool_slots(config.block_size, each.max_num_seqs, max_model_len, chunk_tokens,
                                                 config.state_checkpoint_blocks, each.num_state_cache_slots)
                                for each in (config, fitted))
    log.info("%s: a recurrent state takes %s, so %d sequences' state pool (%d slots, %s) would take more than "
             "%d%% of the KV budget of %s: -np lowered to %d (%d slots, %s; give -np to choose)", model_config.name,
             human_size(slot_bytes), config.max_num_seqs, default_slots, human_size(default_slots * slot_bytes),
             round(STATE_POOL_SHARE * 100), human_size(budget), num_seqs, num_slots, human_size(num_slots * slot_bytes))
    return fitted


def group_pools(model: CausalLM, key_format: KVFormatSpec, value_format: KVFormatSpec, config: EngineConfig,
                max_model_len: int) -> list[GroupPool]:
    """The KV pool of each layer group (kv/group_plan.py), group 0 first: from `config`'s byte budget
    (`kv_budget`), else `num_kv_blocks` for the full group (a window group: its rule's blocks, at most that
    many; a state group: its rule's slots, whatever the budget)."""
    budget = kv_budget(model, config)
    plan = functools.partial(plan_group_pools, model.config, key_format, value_format, block_size=config.block_size,
                             max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                             chunk_tokens=window_chunk_tokens(config),
                             state_checkpoint_blocks=config.state_checkpoint_blocks,
                             state_cache_slots=config.num_state_cache_slots,
                             state_conv_bytes=next(model.parameters()).dtype.itemsize)
    if budget is None:  # --num-kv-blocks: the full group's pool; a window group's by its rule, at most that
        pools = plan(kv_budget=None)
        has_full_group = pools[0].group.sliding_window is None and not pools[0].group.recurrent

        def num_blocks(pool: GroupPool) -> int:
            if pool.group.recurrent:
                return pool.num_blocks
            window = pool.group.sliding_window
            if window is None or not has_full_group:
                return config.num_kv_blocks
            return min(config.num_kv_blocks, window_pool_blocks(window, config.block_size, config.max_num_seqs,
                                                                max_model_len, window_chunk_tokens(config)))

        return [dataclasses.replace(pool, num_blocks=num_blocks(pool)) for pool in pools]
    pools = plan(kv_budget=budget)
    if min(pool.num_blocks for pool in pools) == 0:
        block_bytes = sum(pool.bytes_per_token for pool in pools) * config.block_size
        raise ValueError(f"a KV budget of {human_size(budget)} holds no block of {config.block_size} tokens "
                         f"({human_size(block_bytes)} each over every group)")
    return pools
