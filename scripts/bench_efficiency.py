"""Engine efficiency on the CPU: aggregate decode tokens/s against the model's bare matmuls.

For batch sizes 1, 32 and 128 it measures, in the same run and on the same weights:
- bare: one decode step's matmuls only (q/k/v/o, gate/up/down for every layer, then lm_head), no
  attention, no norms, no engine;
- engine: LLMEngine decoding that many concurrent greedy sequences (16-token prompts), decode steps only.
Prints a markdown table; the ratio engine / bare is what matters (machines are noisy).

    python scripts/bench_efficiency.py [--batches 1 32 128] [--steps 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.default_model import resolve_default_model
from localserve.loading.hf import load_model


@torch.inference_mode()
def bare_matmul_tokens_per_s(model, batch: int, steps: int) -> float:
    layers = model.model.layers
    weights = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights.append((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                        mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
    head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
    x = torch.randn(batch, model.config.hidden_size)
    linear = torch.nn.functional.linear

    def step() -> None:
        h = x
        for q, k, v, o, gate, up, down in weights:
            linear(h, q), linear(h, k), linear(h, v)
            h = linear(h, o)
            h = linear(linear(h, gate) * linear(h, up), down)
        linear(h, head)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return batch / statistics.median(times)


def engine_tokens_per_s(model, batch: int, steps: int) -> float:
    config = EngineConfig(num_kv_blocks=max(64, batch * 8),
                          max_num_seqs=batch, max_num_batched_tokens=max(512, batch))
    engine = build_engine(model, None, config)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request([1 + (i * 7 + j) % 1000 for j in range(16)], params)
    while any(r.num_prefill_tokens for r in list(engine.step_history)[-1:]) or not engine.step_history:
        engine.step()  # prefill steps
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return batch / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(resolve_default_model(), dtype=torch.float32).model
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, SmolLM2-135M-Instruct\n")
    print("| concurrent sequences | bare matmuls tok/s | engine tok/s | engine / bare |")
    print("|---|---|---|---|")
    for batch in args.batches:
        bare = bare_matmul_tokens_per_s(model, batch, args.steps)
        engine = engine_tokens_per_s(model, batch, args.steps)
        print(f"| {batch} | {bare:.1f} | {engine:.1f} | {engine / bare:.0%} |", flush=True)


if __name__ == "__main__":
    main()
