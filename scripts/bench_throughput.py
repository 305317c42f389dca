"""Aggregate throughput: continuous batching (localserve) against static batching (transformers).

One workload, one run, the same model (SmolLM2-135M-Instruct, float32 on the CPU), weights and
machine: 64 requests with prompts of 32-512 tokens and outputs of 16-256 tokens (uniform, fixed
seed), prompts cut from real English text (/usr/share/common-licenses). Every request generates
exactly its output length (EOS ignored), greedy.

- localserve: `LLMEngine` with `--batch` slots (max_num_seqs), requests queued at once, finished
  sequences replaced by waiting ones after any step.
- transformers: `generate` on static batches of the same size in arrival order (left padding); a
  batch runs until its longest output is done, so only the requested tokens are counted as output.

Also the workload of llama.cpp's batched bench (128-token prompts, 128 generated tokens, 1 / 8 / 32
sequences): prompt processing and generation tokens/s, to put beside llama.cpp's 200 / 69 / 132 / 135.

    python scripts/bench_throughput.py [--requests 64] [--batch 16] [--dtype float32] [--skip-hf] [--skip-batched]

`--dtype` sets the weights and activations of both systems (`localserve serve` loads bfloat16 on a CPU
with bf16 instructions, float32 on others).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import DOCS, bar_chart, machine, markdown_table, print_machine, save_raw

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.default_model import resolve_default_model
from localserve.loading.hf import load_model
from localserve.tokenizer.tokenizer import Tokenizer

TEXTS = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1")
# llama.cpp's batched bench on this kind of machine (issue #14): generation tokens/s by sequences.
LLAMA_CPP_GENERATION = {1: 69, 8: 132, 32: 135}


def workload(tokenizer: Tokenizer, num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    text = "\n\n".join(Path("/usr/share/common-licenses", name).read_text() for name in TEXTS)
    corpus = tokenizer.encode(text, add_special_tokens=False)
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len, output_len = int(rng.integers(32, 513)), int(rng.integers(16, 257))
        start = int(rng.integers(0, len(corpus) - prompt_len))
        requests.append((corpus[start:start + prompt_len], output_len))
    return requests


def run_engine(model, requests: list[tuple[list[int], int]], batch: int) -> tuple[float, int]:
    config = EngineConfig(num_kv_blocks=4096, max_num_seqs=batch, max_num_batched_tokens=512)
    engine = build_engine(model, None, config)
    start = time.perf_counter()
    for prompt, output_len in requests:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    final = engine.run_to_completion()
    elapsed = time.perf_counter() - start
    generated = sum(len(out.outputs[0].token_ids) for out in final.values())
    assert generated == sum(n for _, n in requests)
    return elapsed, generated


@torch.inference_mode()
def run_hf(hf_model, requests: list[tuple[list[int], int]], batch: int, pad_id: int) -> tuple[float, int]:
    start = time.perf_counter()
    for first in range(0, len(requests), batch):
        chunk = requests[first:first + batch]
        width = max(len(prompt) for prompt, _ in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(n for _, n in chunk)
        hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                          do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start, sum(n for _, n in requests)


def batched_bench(model, num_seqs: int, prompt_len: int = 128, gen_len: int = 128) -> tuple[float, float]:
    """llama.cpp batched-bench style: (prompt tokens/s, generated tokens/s) for num_seqs parallel sequences."""
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=4096, max_num_seqs=max(num_seqs, 1),
                                                 max_num_batched_tokens=512, enable_prefix_caching=False))
    rng = np.random.default_rng(num_seqs)
    for _ in range(num_seqs):
        engine.add_request(rng.integers(100, 40000, prompt_len).tolist(),
                           SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True))
    start = time.perf_counter()
    while any(step.num_prefill_tokens for step in list(engine.step_history)[-1:]) or not engine.step_history:
        engine.step()  # every prompt prefilled (each step also samples its first tokens)
    prefilled = time.perf_counter()
    engine.run_to_completion()
    done = time.perf_counter()
    return num_seqs * prompt_len / (prefilled - start), num_seqs * (gen_len - 1) / (done - prefilled)


def static_batch_waste(requests: list[tuple[list[int], int]], batch: int) -> float:
    """Decode slots static batches run (each batch until its longest output) over the tokens asked for: the
    ratio continuous batching reaches when a sequence-step costs both systems the same."""
    slots = sum(len(chunk) * max(n for _, n in chunk)
                for chunk in (requests[first:first + batch] for first in range(0, len(requests), batch)))
    return slots / sum(n for _, n in requests)


def plot(results: dict, info: dict, path: Path) -> Path:
    """Output tokens/s of localserve beside the reference of each workload (transformers, llama.cpp)."""
    categories, ours, reference = [f"{results['workload']['requests']} mixed requests"], [], []
    ours.append(results["localserve"]["output_tokens_per_s"])
    reference.append(results.get("transformers", {}).get("output_tokens_per_s", 0.0))
    for num_seqs, rates in results.get("batched", {}).items():
        categories.append(f"batched bench, {num_seqs} seq")
        ours.append(rates["generation_tokens_per_s"])
        reference.append(float(LLAMA_CPP_GENERATION[num_seqs]))
    return bar_chart(path, f"SmolLM2-135M {results['dtype']} on {info['cores']} CPU cores", categories,
                     {"localserve": ours, "transformers (mixed) / llama.cpp Q4_1 (batched)": reference},
                     "output tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-batched", action="store_true")
    args = parser.parse_args()
    info = machine()
    print_machine(info)
    path = resolve_default_model()
    dtype = getattr(torch, args.dtype)
    loaded = load_model(path, dtype=dtype)
    tokenizer = Tokenizer.from_gguf(loaded.gguf_reader)
    requests = workload(tokenizer, args.requests, args.seed)
    results: dict = {"dtype": args.dtype, "workload": {"requests": len(requests), "batch": args.batch,
                                  "prompt_tokens": sum(len(p) for p, _ in requests),
                                  "output_tokens": sum(n for _, n in requests)}}
    rows = []
    elapsed, generated = run_engine(loaded.model, requests, args.batch)
    results["localserve"] = {"seconds": elapsed, "output_tokens_per_s": generated / elapsed}
    rows.append(["localserve (continuous batching)", f"{elapsed:.1f}", f"{generated / elapsed:.1f}", "1.00"])
    if not args.skip_hf:
        import transformers

        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype).eval()
        hf_elapsed, hf_generated = run_hf(hf_model, requests, args.batch, tokenizer.token_to_id("<|endoftext|>") or 0)
        results["transformers"] = {"seconds": hf_elapsed, "output_tokens_per_s": hf_generated / hf_elapsed}
        ratio = (generated / elapsed) / (hf_generated / hf_elapsed)
        results["ratio"] = ratio
        rows.append(["transformers generate (static batches)", f"{hf_elapsed:.1f}",
                     f"{hf_generated / hf_elapsed:.1f}", f"1/{ratio:.2f}"])
        del hf_model
    print(f"\n{len(requests)} requests, {results['workload']['prompt_tokens']} prompt tokens, "
          f"{results['workload']['output_tokens']} output tokens, batch {args.batch}\n")
    print(markdown_table(["system", "seconds", "output tokens/s", "relative"], rows))
    results["static_batch_waste"] = static_batch_waste(requests, args.batch)
    print(f"\nstatic batches run {results['static_batch_waste']:.2f}x the decode slots of the tokens asked for "
          "(the ratio continuous batching reaches at equal cost per sequence-step)")
    if not args.skip_batched:
        batched_rows, results["batched"] = [], {}
        for num_seqs in (1, 8, 32):
            prompt_rate, gen_rate = batched_bench(loaded.model, num_seqs)
            results["batched"][num_seqs] = {"prompt_tokens_per_s": prompt_rate, "generation_tokens_per_s": gen_rate}
            batched_rows.append([num_seqs, f"{prompt_rate:.0f}", f"{gen_rate:.1f}", LLAMA_CPP_GENERATION[num_seqs]])
        print("\n128-token prompts, 128 generated tokens (llama.cpp batched-bench workload; llama.cpp: Q4_1 "
              "weights, 2 threads, prompt processing ~200 tokens/s)\n")
        print(markdown_table(["sequences", "prompt tokens/s", "generation tokens/s",
                              "llama.cpp generation tokens/s"], batched_rows))
    png = plot(results, info, DOCS / f"throughput_{args.dtype}.png")
    print(f"\nplot: {png}; raw numbers: {save_raw(f'throughput_{args.dtype}', info, results)}")

if __name__ == "__main__":
    main()
