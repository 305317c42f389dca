"""Mixture-of-experts layer benchmarks (issue 35), in Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts,
top-8, expert intermediate 768): Markdown tables for docs/BENCHMARKS.md.

CPU (default): one MoE layer through the torch path (router: softmax, top-k, renormalised; then
moe_reference) beside, in the same run, (a) a dense gated MLP with the same active parameters
(intermediate k * 768) and (b) a dense gated MLP over the weights the batch really touches (the distinct
experts its tokens chose, as one matrix): (a) is the issue's comparison, (b) the bound of a memory-bound
CPU, where a batch of 16 tokens reads about 10 times the weights of one token. At batch 1, 16 and 64.

GPU (--device cuda): random Q4_K_M-mixed GGUF blocks (gate and up Q4_K, down Q6_K as in Q4_K_M's
more-bits layers), fused_moe over a stack of layers with their own experts and routings, run one after
another as in a decode step (so no layer's weights are still in the L2 cache), eagerly and replayed from
a CUDA graph; per layer: time, the bytes of the experts the batch chose (each read once), and at batch 1
the fraction of the roofline, those bytes at the device's copy bandwidth (bytes read plus written per
second of a large device-to-device copy). Batch 16 and 64 through both methods.

Usage: python scripts/bench_moe.py [--device cpu|cuda] [--dtype bfloat16|float32] [--out results.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from benchlib import machine, markdown_table, print_machine, row_emitter

HIDDEN, NUM_EXPERTS, TOP_K, INTERMEDIATE = 2048, 128, 8, 768
BATCHES = [1, 16, 64]


def route(x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router: softmax over the experts, the top k, renormalised."""
    probabilities = torch.softmax((x @ router.T).float(), dim=-1)
    weights, ids = torch.topk(probabilities, TOP_K, dim=-1)
    return ids, (weights / weights.sum(-1, keepdim=True)).to(x.dtype)


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def median_seconds(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def touched_mlp_seconds(x: torch.Tensor, experts, touched: torch.Tensor, repeats: int) -> float:
    """A dense gated MLP over the `touched` experts' weights, as one matrix each (intermediate 768 a piece)."""
    gate = experts.gate.data[touched].reshape(-1, HIDDEN)
    up = experts.up.data[touched].reshape(-1, HIDDEN)
    down = experts.down.data[touched].transpose(0, 1).reshape(HIDDEN, -1)
    return median_seconds(lambda: gated_mlp(x, gate, up, down), repeats)


def cpu_rows(dtype: torch.dtype, repeats: int, emit) -> None:
    from localserve.kernels.moe_experts import ExpertMatrix, Experts, moe_reference

    generator = torch.Generator().manual_seed(0)

    def weights(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) / shape[-1] ** 0.5).to(dtype)

    experts = Experts(ExpertMatrix(weights(NUM_EXPERTS, INTERMEDIATE, HIDDEN), HIDDEN),
                      ExpertMatrix(weights(NUM_EXPERTS, INTERMEDIATE, HIDDEN), HIDDEN),
                      ExpertMatrix(weights(NUM_EXPERTS, HIDDEN, INTERMEDIATE), INTERMEDIATE))
    router = weights(NUM_EXPERTS, HIDDEN)
    active = TOP_K * INTERMEDIATE
    dense = (weights(active, HIDDEN), weights(active, HIDDEN), weights(HIDDEN, active))
    rows = []
    for batch in BATCHES:
        x = torch.randn(batch, HIDDEN, generator=generator).to(dtype)
        touched = torch.unique(route(x, router)[0])
        with torch.inference_mode():
            moe = median_seconds(lambda: moe_reference(x, experts, *route(x, router)), repeats)  # noqa: B023
            same_active = median_seconds(lambda: gated_mlp(x, *dense), repeats)  # noqa: B023
            same_touched = touched_mlp_seconds(x, experts, touched, repeats)
        rows.append([batch, len(touched), f"{moe * 1e3:.2f}", f"{same_active * 1e3:.2f}",
                     f"**{moe / same_active:.2f}x**", f"{same_touched * 1e3:.2f}", f"{moe / same_touched:.2f}x"])
    emit(["", f"MoE layer on the CPU, torch path, {str(dtype).removeprefix('torch.')}, Qwen3-30B-A3B shape "
          f"(median of {repeats}):", "",
          markdown_table(["batch", "experts touched", "MoE layer ms", "dense MLP, same active params, ms",
                          "MoE / dense", "dense MLP over the touched experts, ms", "MoE / touched"], rows)])


def random_blocks(qtype: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Random valid GGUF blocks uint8 [*shape[:-1], row_bytes] for weights of `shape` (scripts/bench_kernels.py)."""
    from bench_kernels import random_gguf_blocks

    return random_gguf_blocks(qtype, shape[:-1].numel(), shape[-1], generator).reshape(*shape[:-1], -1)


def gpu_rows(device: torch.device, num_layers: int, emit) -> None:
    import triton
    import triton.testing
    from bench_kernels import copy_bandwidth
    from localserve.kernels.fused_moe import fused_moe
    from localserve.kernels.gguf_blocks import QUANT_FORMATS
    from localserve.kernels.moe_experts import ExpertMatrix, Experts

    bandwidth = copy_bandwidth(device)
    generator = torch.Generator(device=device).manual_seed(0)
    q4_k, q6_k = QUANT_FORMATS["Q4_K"], QUANT_FORMATS["Q6_K"]
    gate_up, down = torch.Size((NUM_EXPERTS, INTERMEDIATE, HIDDEN)), torch.Size((NUM_EXPERTS, HIDDEN, INTERMEDIATE))
    layers = [Experts(ExpertMatrix(random_blocks("Q4_K", gate_up, generator), HIDDEN, q4_k),
                      ExpertMatrix(random_blocks("Q4_K", gate_up, generator), HIDDEN, q4_k),
                      ExpertMatrix(random_blocks("Q6_K", down, generator), INTERMEDIATE, q6_k))
              for _ in range(num_layers)]
    expert_bytes = sum(m.data[0].numel() for m in (layers[0].gate, layers[0].up, layers[0].down))
    emit([f"Device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written). {num_layers} layers of "
          f"{NUM_EXPERTS} experts, {expert_bytes / 1e6:.2f} MB each (gate, up Q4_K; down Q6_K).", "",
          "| batch | method | mode | us per layer | experts chosen per layer | MB read per layer | GB/s "
          "| of roofline (batch 1) |", "|---|---|---|---|---|---|---|---|"])
    for batch in BATCHES:
        inputs = []
        for _ in range(num_layers):
            x = torch.randn(batch, HIDDEN, device=device, generator=generator).to(torch.bfloat16)
            ids = torch.topk(torch.rand(batch, NUM_EXPERTS, device=device, generator=generator), TOP_K).indices
            weights = torch.softmax(torch.randn(batch, TOP_K, device=device, generator=generator), -1)
            inputs.append((x, ids, weights))
        chosen = sum(torch.unique(ids).numel() for _, ids, _ in inputs) / num_layers
        read = chosen * expert_bytes + 2 * batch * HIDDEN * 2
        for method in (["per_token"] if batch == 1 else ["per_token", "grouped"]):
            def step(method=method, inputs=inputs):
                for experts, (x, ids, weights) in zip(layers, inputs, strict=True):
                    fused_moe(x, experts, ids, weights, method=method)

            for mode, bench in (("eager", triton.testing.do_bench), ("graph", triton.testing.do_bench_cudagraph)):
                seconds = bench(step, return_mode="median") / 1e3 / num_layers
                roofline = f"{read / bandwidth / seconds:.0%}" if batch == 1 else "-"
                emit([f"| {batch} | {method} | {mode} | {seconds * 1e6:.1f} | {chosen:.1f} | {read / 1e6:.1f} | "
                      f"{read / seconds / 1e9:.0f} | {roofline} |"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="CPU section")
    parser.add_argument("--repeats", type=int, default=9, help="CPU section: timed runs per cell")
    parser.add_argument("--threads", type=int, help="CPU section: torch threads (default: torch's)")
    parser.add_argument("--layers", type=int, default=12, help="GPU section: layers in the stack")
    parser.add_argument("--out", type=Path, help="also write the Markdown tables here, row by row")
    args = parser.parse_args()
    emit = row_emitter(args.out)

    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine()
    print_machine(info)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda needs a CUDA device")
        gpu_rows(torch.device("cuda"), args.layers, emit)
    else:
        cpu_rows(getattr(torch, args.dtype), args.repeats, emit)


if __name__ == "__main__":
    main()
