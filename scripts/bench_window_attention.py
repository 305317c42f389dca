"""Decode attention of sliding-window layers with sinks (issue #36): does a window decode cost O(window)?

Per layer shape (gpt-oss-20b: 64 query heads, 8 KV heads, head size 64, window 128, sinks; Gemma 3 27B's
window layers: 32 / 16 x 128, window 1024; Gemma 4's global layers: head size 512, keys as values, no
window), per context (1K / 8K / 32K) and batch (1 / 16 / 64): the median time of one layer's attention
through the Triton backend, the cache bytes its window must read, GB/s, the fraction of the copy bandwidth,
the key tiles each program visited (the kernel's own count) and, beside it, the same layer without a
window (what a full-attention layer would cost). A window decode's time should stay flat as the context
grows; the full layer's grows with it.

`--dry-run` runs the same path on a CPU in Triton's interpreter (tiny shapes, no timing): it checks that
the script, its pools and the tile counts work where no GPU is (scripts/gpu_check.sh window runs it for
real). Usage: python scripts/bench_window_attention.py [--device cuda] [--quick | --dry-run] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import triton.testing
from benchlib import row_emitter
from localserve.kernels.attention_plan import plan_attention
from localserve.kernels.paged_attention import paged_attention

from localserve.attention.triton_backend import kv_store
from localserve.kv.cache import LayerKVShape, PagedKVCache

BLOCK_SIZE = 16
# name: (query heads, KV heads, head size, window, sinks, keys as values)
LAYERS = {"gpt-oss-20b window": (64, 8, 64, 128, True, False),
          "Gemma 3 27B window": (32, 16, 128, 1024, False, False),
          "Gemma 4 global": (32, 4, 512, None, False, True)}
CONTEXTS, BATCHES = [1024, 8192, 32768], [1, 16, 64]


def copy_bandwidth(device: torch.device, num_bytes: int = 1 << 30) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / (triton.testing.do_bench(lambda: target.copy_(source), return_mode="median") / 1e3)


def decode_row(name: str, layer: tuple, context: int, batch: int, device: torch.device, bandwidth: float | None,
               window_off: bool = False) -> tuple[str, int]:
    """One table row: a decode step of `batch` sequences at `context` over one layer; -> (row, tiles visited
    by the busiest program)."""
    num_heads, num_kv_heads, head_dim, window, sinks, kv = layer
    window = None if window_off else window
    blocks = context // BLOCK_SIZE
    cache = PagedKVCache(1, batch * blocks, BLOCK_SIZE, num_kv_heads, head_dim, torch.bfloat16, device=device,
                         layer_shapes=[LayerKVShape(num_kv_heads, head_dim, kv)])
    for store in {id(s): s for s in (cache.key_stores[0], cache.value_stores[0])}.values():
        store["values"].normal_()
    tables = torch.randperm(batch * blocks, device=device).view(batch, blocks)
    if window is not None:  # the blocks wholly before the window are gone (a window group frees them)
        tables[:, :max(0, context - window) // BLOCK_SIZE] = -1
    plan = plan_attention([1] * batch, [context] * batch, tables, num_heads, num_kv_heads, head_dim=head_dim,
                          window=window, num_sms=torch.cuda.get_device_properties(device).multi_processor_count
                          if device.type == "cuda" else None)
    query = torch.randn(batch, num_heads, head_dim, device=device, dtype=torch.bfloat16)
    sink_logits = torch.randn(num_heads, device=device) if sinks else None
    formats = [codec[0].kernel_format(device) for codec in (cache.key_codecs, cache.value_codecs)]
    stores = (kv_store(cache.key_stores[0]), kv_store(cache.value_stores[0]))
    counts = torch.zeros(plan.tile_seq.shape[0], num_kv_heads, plan.num_splits, dtype=torch.int32, device=device)
    paged_attention(query, *stores, *formats, plan, head_dim ** -0.5, window=window, sinks=sink_logits,
                    tile_counts=counts)
    visited = int(counts.sum(-1).max())
    keys = min(context, window or context)
    bytes_read = batch * keys * cache.bytes_per_token()
    label = f"| {name}{' (no window)' if window_off else ''} | {context:,} | {batch} |"
    if bandwidth is None:
        return f"{label} - | {bytes_read / 1e6:.2f} | - | - | {visited} | {plan.num_splits} |", visited
    milliseconds = triton.testing.do_bench(
        lambda: paged_attention(query, *stores, *formats, plan, head_dim ** -0.5, window=window,
                                sinks=sink_logits), return_mode="median")
    achieved = bytes_read / (milliseconds / 1e3)
    return (f"{label} {milliseconds * 1e3:.1f} | {bytes_read / 1e6:.2f} | {achieved / 1e9:.0f} | "
            f"{achieved / bandwidth:.0%} | {visited} | {plan.num_splits} |"), visited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="8K and 32K at batch 1 and 16 only")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes, no timing")
    parser.add_argument("--out", type=Path, help="also write the Markdown table here, row by row")
    args = parser.parse_args()
    emit = row_emitter(args.out)
    if args.dry_run:
        device, bandwidth = torch.device("cpu"), None
        layers = {"window 32, sinks": (4, 2, 64, 32, True, False), "head 512, K = V": (4, 1, 512, None, False, True)}
        contexts, batches = [256, 1024], [2]
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            sys.exit("bench_window_attention.py needs a CUDA device (or --dry-run)")
        device = torch.device(args.device)
        bandwidth = copy_bandwidth(device)
        emit([f"Device: {torch.cuda.get_device_name(device)}; copy bandwidth {bandwidth / 1e9:.0f} GB/s."])
        layers = LAYERS
        contexts, batches = ([8192, 32768], [1, 16]) if args.quick else (CONTEXTS, BATCHES)
    emit(["", "Window decode attention, one layer (bf16 model and cache):", "",
          "| layer | context | batch | Triton us | cache MB its window reads | GB/s | of copy bw | key tiles "
          "visited | splits |", "|---|---|---|---|---|---|---|---|---|"])
    for name, layer in layers.items():
        window_tiles = set()
        for context in contexts:
            for batch in batches:
                row, visited = decode_row(name, layer, context, batch, device, bandwidth)
                emit([row])
                if layer[3] is not None:
                    window_tiles.add(visited)
                    emit([decode_row(name, layer, context, batch, device, bandwidth, window_off=True)[0]])
        if len(window_tiles) > 1 and max(window_tiles) > min(window_tiles) + 1:
            sys.exit(f"{name}: the tiles a window decode visits grew with the context: {sorted(window_tiles)}")


if __name__ == "__main__":
    main()
