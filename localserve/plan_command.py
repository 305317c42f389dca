"""`localserve plan`: what fits on a device for a model, from its metadata alone (no weight is read): per
KV format, bytes per token, tokens that fit and sequences at 8K and 32K; with window layers, their pools;
with recurrent layers, their state pool's share (and, where -np is not given, the sequences the server would
choose to fit it, engine/builder.py's rule)."""

from __future__ import annotations

import argparse

from localserve.engine.config import DEFAULT_MAX_NUM_SEQS, STATE_CHECKPOINT_TOKENS
from localserve.kv.group_plan import fit_state_sequences, state_slot_bytes
from localserve.kv.memory_plan import (
    DEFAULT_UTILIZATION,
    PLAN_FORMATS,
    describe_state_pool,
    format_plan,
    human_size,
    kv_budget_bytes,
    parse_size,
    plan,
    uncalibrated,
)


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `localserve plan`."""
    parser.add_argument("-m", "--model",
                        help="config.json, HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--vram", default="24GB",
                        help="device memory, e.g. 24GB (binary units; default 24GB)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="fraction of the device for weights + KV pool (default 0.9)")
    parser.add_argument("--kv-budget", help="explicit KV pool size, e.g. 6GB (overrides --vram)")
    parser.add_argument("--weights", help="weight size, e.g. 4.9GB (default: parameters x 2 bytes, or a .gguf's "
                                          "stored size where its quantized blocks are kept)")
    parser.add_argument("--keep-quantized-weights", action=argparse.BooleanOptionalAction, default=True,
                        help="count a .gguf's quantized weights (and a folder's MXFP4 experts) at their stored "
                             "size, as the server keeps them on a GPU (default: on)")
    parser.add_argument("--mmproj", metavar="FILE",
                        help="the model's llama.cpp mmproj file: its vision encoder's weights count too (at 2 bytes "
                             "a parameter, as the server holds them on a GPU)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("-np", "--parallel", type=int,
                        help=f"sequences at once: what a window or state group's pool is sized for (default "
                             f"{DEFAULT_MAX_NUM_SEQS}, or fewer where recurrent states would take over half the "
                             f"pool, as the server chooses)")
    parser.add_argument("-c", "--ctx-size", type=int,
                        help="longest prompt, for a window layer group's pool without chunked prefill (default: "
                             "the model's context)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="a step's tokens: the prefill chunk a window layer group's pool holds per slot "
                             "(default 512; 0: no chunked prefill)")
    parser.add_argument("--state-checkpoint-tokens", type=int, default=STATE_CHECKPOINT_TOKENS,
                        help="recurrent layers: tokens between two state checkpoints, as the server's flag "
                             f"(default {STATE_CHECKPOINT_TOKENS})")
    parser.add_argument("--state-cache-slots", type=int,
                        help="recurrent layers: state slots kept for cached checkpoints (default: one per -np slot)")


def cmd_plan(args: argparse.Namespace) -> int:
    """Print, per KV format, bytes per token, tokens that fit and sequences at 8K and 32K."""
    from localserve.loading.plan_model import load_plan_model

    utilization = args.gpu_memory_utilization or DEFAULT_UTILIZATION
    config, weight_bytes, weight_source = load_plan_model(args.model,
                                                          keep_quantized_weights=args.keep_quantized_weights)
    if args.weights:
        weight_bytes, weight_source = parse_size(args.weights), "given"
    elif args.mmproj:
        from localserve.loading.mmproj import mmproj_weight_bytes, read_mmproj

        encoder_bytes = mmproj_weight_bytes(read_mmproj(args.mmproj))
        weight_bytes += encoder_bytes
        weight_source += f" + mmproj {human_size(encoder_bytes)}"
    if args.kv_budget:
        budget = parse_size(args.kv_budget)
        where = f"KV budget {human_size(budget)}"
    else:
        total = parse_size(args.vram)
        budget = kv_budget_bytes(total, weight_bytes, utilization)
        where = (f"{human_size(total)} x {utilization:g} - weights {human_size(weight_bytes)} "
                 f"({weight_source}) = KV pool {human_size(budget)}")
    print(f"{config.name}: {config.num_layers} layers x {config.num_kv_heads} KV heads x head_dim "
          f"{config.head_dim}; {where}; blocks of {args.block_size} tokens")
    chunk = args.max_num_batched_tokens or None
    formats = PLAN_FORMATS
    if config.recurrent_layers:  # the calibration runs attention layers only: the 4-bit format without it
        formats = tuple(tuple(uncalibrated(f) for f in pair) for pair in PLAN_FORMATS)
    if args.state_checkpoint_tokens < args.block_size or args.state_checkpoint_tokens % args.block_size:
        print(f"--state-checkpoint-tokens must be a positive multiple of --block-size {args.block_size}")
        return 2
    checkpoint_blocks = args.state_checkpoint_tokens // args.block_size
    num_seqs = args.parallel or DEFAULT_MAX_NUM_SEQS
    if args.parallel is None and config.recurrent_layers and budget:  # the server's own choice (engine/builder.py)
        num_seqs = fit_state_sequences(state_slot_bytes(config, tuple(config.recurrent_layers), 2), budget,
                                       args.block_size, DEFAULT_MAX_NUM_SEQS, args.ctx_size or config.context_length,
                                       chunk, checkpoint_blocks, args.state_cache_slots)
        if num_seqs < DEFAULT_MAX_NUM_SEQS:
            print(f"-np not given: {num_seqs} sequences, as the server would run (its recurrent states' pool at "
                  f"{DEFAULT_MAX_NUM_SEQS} would take more than half the KV pool)")
    try:
        rows = plan(config, budget, args.block_size, formats, max_num_seqs=num_seqs, max_model_len=args.ctx_size,
                    chunk_tokens=chunk, state_checkpoint_blocks=checkpoint_blocks,
                    state_cache_slots=args.state_cache_slots)
    except ValueError as exc:
        print(exc)
        return 1
    if rows[0].state_pool is not None:
        print(describe_state_pool(config, rows[0], budget, args.block_size))
    if rows[0].window_pools:
        num_full_layers = config.num_layers - sum(len(pool.group.layers) for pool in rows[0].window_pools)
        rule = (f"(ceil((W + {chunk} - 1) / {args.block_size}) + 1) blocks" if chunk else
                f"(ceil(W / {args.block_size}) + 1) blocks + one {args.ctx_size or config.context_length:,}-token "
                f"prompt")
        print(f"layer groups: full ({num_full_layers} layers) and "
              + ", ".join(f"{pool.label} ({len(pool.group.layers)} layers)" for pool in rows[0].window_pools)
              + f"; a window pool holds {num_seqs} slots x {rule}; tokens that fit: the full layers' pool")
    print(format_plan(rows, block_size=args.block_size))
    if budget == 0:
        print("the weights alone fill the device: no room for a KV pool")
    return 0 if budget else 1
