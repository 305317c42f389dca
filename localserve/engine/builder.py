"""Putting an engine together for a loaded model: the attention backend chosen, the KV pool sized and
allocated (with the 4-bit format's calibration when a format needs it), the block manager, the scheduler
and the model runner built, and handed to `LLMEngine`, which only runs them."""

from __future__ import annotations

import dataclasses
import logging

import torch

from localserve.attention import select_backend
from localserve.engine.config import EngineConfig
from localserve.engine.engine import LLMEngine
from localserve.engine.events import EventLog
from localserve.engine.kv_calibration import load_or_calibrate
from localserve.engine.model_runner import ModelRunner
from localserve.engine.scheduler import Scheduler
from localserve.kv.block_manager import BlockManager
from localserve.kv.cache import PagedKVCache
from localserve.kv.codecs import dtype_format
from localserve.kv.formats import KVFormatSpec
from localserve.kv.memory_plan import human_size, kv_budget_bytes, kv_bytes_per_token, num_kv_blocks
from localserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def build_engine(model: LlamaForCausalLM, tokenizer=None, config: EngineConfig | None = None) -> LLMEngine:
    """An engine for `model` with `config`'s pool, scheduling and attention settings.

    Raises ValueError when the backend asked for cannot run here with these formats, or the pool's memory
    budget holds no block; both before the pool is allocated.
    """
    config = config or EngineConfig()
    param = next(model.parameters())
    model_config = model.config
    key_format = config.cache_type_k or dtype_format(param.dtype)
    value_format = config.cache_type_v or dtype_format(param.dtype)
    backend, why = select_backend(config.attention_backend, param.device, key_format, value_format,
                                  model_config.head_dim)
    log.info("attention backend: %s", why)
    if config.kv_cache_memory_bytes or config.gpu_memory_utilization:
        config = dataclasses.replace(config, num_kv_blocks=pool_blocks(model, key_format, value_format, config))
    scheduler_config = config.scheduler_config()
    num_cpu_blocks = config.num_cpu_blocks or (
        config.num_kv_blocks if scheduler_config.preemption_mode == "swap" else 0)
    kv_cache = build_kv_cache(model, tokenizer, key_format, value_format, config.num_kv_blocks, config.block_size,
                              num_cpu_blocks)
    max_model_len = min(config.max_model_len or model_config.context_length, model_config.context_length)
    block_manager = BlockManager(config.num_kv_blocks, config.block_size, num_cpu_blocks,
                                 config.enable_prefix_caching)
    events = EventLog()
    return LLMEngine(config, ModelRunner(model, kv_cache, backend, max_model_len), block_manager,
                     Scheduler(scheduler_config, block_manager, events), events, tokenizer, max_model_len=max_model_len)


def build_kv_cache(model: LlamaForCausalLM, tokenizer, key_format: KVFormatSpec, value_format: KVFormatSpec,
                   num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> PagedKVCache:
    """The paged pool for `model`'s K and V in these formats, on the model's device; a format that needs the
    model's calibration gets it (computed once per model and machine) with the model's RoPE."""
    param = next(model.parameters())
    model_config = model.config
    calibration = rope = None
    if key_format.needs_calibration or value_format.needs_calibration:
        calibration = load_or_calibrate(model, tokenizer)
        rope = lambda positions: model.rotary(positions, torch.float32)  # noqa: E731
    return PagedKVCache(model_config.num_layers, num_blocks, block_size, model_config.num_kv_heads,
                        model_config.head_dim, param.dtype, param.device, num_cpu_blocks, key_format, value_format,
                        calibration, rope)


def pool_blocks(model: LlamaForCausalLM, key_format: KVFormatSpec, value_format: KVFormatSpec,
                config: EngineConfig) -> int:
    """KV blocks for a loaded model: from `config`'s byte budget, else from its fraction of the CUDA device,
    less what is already allocated there (the weights)."""
    device = next(model.parameters()).device
    budget = config.kv_cache_memory_bytes
    if budget is None:
        if device.type != "cuda":
            raise ValueError("--gpu-memory-utilization needs a CUDA device; give a KV budget in bytes instead")
        budget = kv_budget_bytes(torch.cuda.get_device_properties(device).total_memory,
                                 torch.cuda.memory_allocated(device), config.gpu_memory_utilization)
    per_token = kv_bytes_per_token(model.config, key_format, value_format)
    blocks = num_kv_blocks(budget, per_token, config.block_size)
    if blocks == 0:
        raise ValueError(f"a KV budget of {human_size(budget)} holds no block of {config.block_size} tokens "
                         f"({human_size(per_token * config.block_size)} each)")
    return blocks
