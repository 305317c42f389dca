"""Speculative decoding against none, side by side in one run: output tokens per second of the same greedy
requests (the same tokens: greedy output is identical), at batch 1, 8 and 32.

Workloads, each a chat request to the default model (SmolLM2-135M-Instruct, as `localserve serve` loads it):
- code editing: a source file of this repository, to be given back whole with a function renamed;
- document Q&A: a passage of a license text, one paragraph of it to be repeated exactly as written;
- plain chat: the serving benchmark's prompts ("Summarize: " + 20-300 words of license text).
Drafters: prompt lookup (`--spec-type ngram`) and, at batch 1, a draft model made of the default model's
first `--draft-layers` layers (sharing their weights: no other model of its tokenizer is at hand here).
Each batch of requests runs with speculation off, then with each drafter, back to back, on fresh engines over
one loaded model; the machine's load average is printed with every row (the CPU is shared: compare the
columns of a row, not rows of different runs).

    python scripts/bench_speculative.py [--threads 1] [--max-tokens 256] [--batches 1 8 32] [--prompts-per-cell 3]
    python scripts/bench_speculative.py --device cuda --batches 1 8 32 64   # the GPU section (gpu_check.sh)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time
from pathlib import Path

import torch
from benchlib import machine, markdown_table, print_machine, save_raw
from localserve.models.llama import LlamaForCausalLM
from torch import nn

from localserve.engine.builder import build_engine
from localserve.engine.config import SPEC_TOKENS, EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.llm import LLM

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FILES = ["localserve/engine/stop_rules.py", "localserve/kv/block_hash.py", "localserve/engine/request_queues.py",
                "localserve/kv/followers.py", "localserve/engine/spec_state.py", "localserve/kv/free_queue.py",
                "localserve/engine/facts.py", "localserve/kv/block_tier.py"]
LICENSES = "\n".join(Path("/usr/share/common-licenses", name).read_text()
                     for name in ("GPL-3", "Apache-2.0", "MPL-2.0"))
WORDS = re.findall(r"\S+", LICENSES)
PARAGRAPHS = [p.strip() for p in LICENSES.split("\n\n") if 300 < len(p.strip()) < 1400]


def code_editing(index: int) -> str:
    path = SOURCE_FILES[index % len(SOURCE_FILES)]
    source = (ROOT / path).read_text()
    name = re.search(r"^def (\w+)|^    def (\w+)", source, re.M)
    old = next(group for group in name.groups() if group)
    return (f"Here is the file {path}:\n\n```python\n{source}```\n\nRewrite this file with the function `{old}` "
            f"renamed to `{old}_checked` everywhere. Reply with the complete new file only.")


def document_qa(index: int) -> str:
    quoted = PARAGRAPHS[(7 * index) % len(PARAGRAPHS)]
    start = max(0, LICENSES.index(quoted) - 900)
    document = LICENSES[start:LICENSES.index(quoted) + len(quoted) + 600]
    opening = " ".join(quoted.split()[:8])
    # Asked this way the default model quotes (asked to "quote the paragraph that contains a word" it
    # answers with a sentence of its own, 25 tokens, and nothing is measured).
    return f"{document}\n\nRepeat the paragraph above that begins with \"{opening}\", exactly as written."


def plain_chat(index: int) -> str:
    import numpy as np

    rng = np.random.default_rng(index)
    num_words = int(rng.integers(20, 300))
    start = int(rng.integers(0, len(WORDS) - num_words))
    return "Summarize: " + " ".join(WORDS[start:start + num_words])


WORKLOADS = {"code editing": code_editing, "document Q&A": document_qa, "plain chat": plain_chat}


def first_layers(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A draft model: the model's embedding, first `num_layers` layers, final norm and head (weights shared)."""
    draft = LlamaForCausalLM.__new__(LlamaForCausalLM)
    nn.Module.__init__(draft)
    draft.config = dataclasses.replace(model.config, num_layers=num_layers)
    draft.model = nn.Module()
    draft.model.embed_tokens, draft.model.norm = model.model.embed_tokens, model.model.norm
    draft.model.layers = nn.ModuleList(model.model.layers[:num_layers])
    if hasattr(model, "lm_head"):
        draft.lm_head = model.lm_head
    draft.rotary = model.rotary
    return draft


def run_cell(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: int, spec_type: str | None,
             draft_model=None, spec_tokens: int = SPEC_TOKENS) -> dict:
    """Run the prompts `batch` at a time on a fresh engine; output tokens per second over the whole cell."""
    config = EngineConfig(num_kv_blocks=4096, max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, batch),
                          spec_type=spec_type, spec_tokens=spec_tokens)
    engine = build_engine(llm.engine.runner.model, llm.tokenizer, config, draft_model=draft_model)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    # Warm-up: one short request (first-call costs of the kernels and allocator) and, with speculation,
    # the step cost model's first observations.
    engine.add_request(prompts[0][:64], SamplingParams(temperature=0, max_tokens=16))
    engine.run_to_completion()
    tokens, seconds, outputs = 0, 0.0, []
    for start in range(0, len(prompts), batch):
        ids = [engine.add_request(prompt, params) for prompt in prompts[start:start + batch]]
        began = time.perf_counter()
        final = engine.run_to_completion()
        seconds += time.perf_counter() - began
        for request_id in ids:
            outputs.append(list(final[request_id].token_ids))
            tokens += len(outputs[-1])
    result = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "outputs": outputs,
              "load": os.getloadavg()[0]}
    if engine.scheduler.speculation is not None:
        totals = engine.scheduler.speculation.totals
        result |= {"drafted": totals.num_draft_tokens, "accepted": totals.num_accepted_tokens,
                   "verifications": totals.num_drafts}
    return result


def merged(cells: list[dict]) -> dict:
    """One mode's cells of a row (its requests, run interleaved with the other modes') as one result."""
    tokens, seconds = sum(cell["tokens"] for cell in cells), sum(cell["seconds"] for cell in cells)
    result = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
              "outputs": [output for cell in cells for output in cell["outputs"]],
              "load": sum(cell["load"] for cell in cells) / len(cells)}
    if "drafted" in cells[0]:
        drafted, accepted, verifications = (sum(cell[key] for cell in cells)
                                            for key in ("drafted", "accepted", "verifications"))
        result |= {"drafted": drafted, "accepted": accepted, "verifications": verifications,
                   "acceptance_rate": accepted / drafted if drafted else 0.0,
                   "mean_accepted_length": 1 + accepted / verifications if verifications else 0.0}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared CPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", help="default: what `localserve serve` loads on the device")
    parser.add_argument("--max-tokens", type=int, default=256, help="per request at batch 1 (half at larger batches)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts-per-cell", type=int, default=3, help="requests of a batch-1 cell, one after another")
    parser.add_argument("--spec-tokens", type=int, default=SPEC_TOKENS,
                        help=f"K, drafted tokens a step at most (the CLI's default, {SPEC_TOKENS})")
    parser.add_argument("--draft-layers", type=int, default=6, help="layers of the draft model (0: no draft rows)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--json", default="speculative", help="docs/bench/NAME.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from localserve.loading.hf import serving_dtype

    dtype = getattr(torch, args.dtype) if args.dtype else serving_dtype(args.device)
    llm = LLM(None, dtype=dtype, device=args.device, engine_config=EngineConfig(num_kv_blocks=16))
    info = machine() | {"dtype": str(dtype).removeprefix("torch."), "load_at_start": os.getloadavg()}
    print_machine(info)
    print(f"dtype {info['dtype']}, load average at start {info['load_at_start']}")
    draft = first_layers(llm.engine.runner.model, args.draft_layers) if args.draft_layers else None
    rows, raw = [], []
    for batch in args.batches:
        for workload in args.workloads:
            count = args.prompts_per_cell if batch == 1 else batch
            prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": WORKLOADS[workload](i)}])
                       for i in range(count)]
            max_tokens = args.max_tokens if batch == 1 else args.max_tokens // 2
            drafters = [("ngram", None)] + ([("draft", draft)] if draft is not None and batch == 1 else [])
            # Each batch of requests runs in every mode back to back, so that the machine's load (shared)
            # changes little between the modes compared.
            modes = [(None, None), *drafters]
            cells: dict[str | None, list[dict]] = {spec_type: [] for spec_type, _ in modes}
            for start in range(0, count, batch):
                for spec_type, draft_model in modes:
                    cells[spec_type].append(run_cell(llm, prompts[start:start + batch], max_tokens, batch, spec_type,
                                                     draft_model, args.spec_tokens))
            off = merged(cells[None])
            for spec_type, _ in drafters:
                on = merged(cells[spec_type])
                same = on["outputs"] == off["outputs"]
                name = spec_type if spec_type == "ngram" else f"draft ({args.draft_layers} of "
                name += "" if spec_type == "ngram" else f"{llm.model_config.num_layers} layers)"
                rows.append([workload, batch, name, f"{off['tokens_per_s']:.1f}", f"{on['tokens_per_s']:.1f}",
                             f"**{on['tokens_per_s'] / off['tokens_per_s']:.2f}x**", f"{on['acceptance_rate']:.0%}",
                             f"{on['mean_accepted_length']:.2f}", on["tokens"], "yes" if same else "**no**",
                             f"{off['load']:.1f} / {on['load']:.1f}"])
                raw.append({"workload": workload, "batch": batch, "drafter": name, "off": _strip(off), "on": _strip(on),
                            "identical": same})
                print(markdown_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(HEADERS, rows))
    path = save_raw(args.json, info | {"load_at_end": os.getloadavg()}, raw)
    print(f"\nload average at end {os.getloadavg()}; raw numbers: {path}")


HEADERS = ["workload", "batch", "drafter", "off tok/s", "on tok/s", "speed-up", "accepted", "tokens/verify",
           "output tokens", "same tokens", "load (off / on)"]


def _strip(result: dict) -> dict:
    return {key: value for key, value in result.items() if key != "outputs"}


if __name__ == "__main__":
    main()
