"""Where the time of one decode step goes, at 1, 32 and 128 running sequences (SmolLM2, CPU).

Each stage is timed in place during real engine steps (wrappers on the engine's parts and forward
hooks on the model's modules; on the CPU every operation has finished when it returns): scheduling,
building the step's tensors, the model forward split by layer part (embedding, norms, q/k/v
projections with RoPE, attention including the KV write, output projection, MLP, final norm and
lm_head), sampling, detokenization, the rest of the output path, and what sending costs the server
(building the response events of the step's outputs and their JSON). Prints a table of milliseconds
per step and shares of the step.

With `--constrained` every request has a JSON-schema grammar (scripts/bench_constrained.py's), and the
table's "grammar masks" row is what the step spent on them: waiting after the forward for the masks
(filled on a worker thread while the model runs) and adding them to the logits; the worker's own fill
per step is printed under the table.

    python scripts/profile_step.py [--batches 1 32 128] [--steps 16] [--constrained] \
        [--dtype bfloat16] [--prompt-tokens 500]   # the serving benchmark's dtype and context lengths
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from bench_constrained import GRAMMAR
from benchlib import DOCS, bar_chart, machine, markdown_table, percentile, print_machine, save_raw

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.default_model import resolve_default_model
from localserve.loading.hf import load_model
from localserve.server.generation.stream import GenerationStream
from localserve.server.openai.responses_events import ResponsesEvents
from localserve.server.openai.responses_format import RESPONSES_WEBSOCKET
from localserve.server.request.fields import parse_request
from localserve.server.request.generation_request import RequestLimits
from localserve.tokenizer.tokenizer import StreamDecoder, Tokenizer

LICENSE_TEXT = Path("/usr/share/common-licenses/GPL-3").read_text()
STAGES = ("schedule", "prepare inputs", "embedding", "norms", "q/k/v projections", "RoPE tables", "attention",
          "output projection", "MLP", "lm_head", "grammar masks", "sampling", "detokenization", "other output path",
          "sending (events + JSON)")


class Clock:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.on = False

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.on:
                self.totals[name] += time.perf_counter() - start

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            with self.stage(name):
                return fn(*args, **kwargs)
        return timed


def hook_modules(model, clock: Clock) -> list:
    """Time module calls with forward hooks (the start in a pre-hook); returns the hooks' handles."""
    handles = []

    def attach(module, name: str) -> None:
        starts: list[float] = []

        def done(*_):
            elapsed = time.perf_counter() - starts.pop()
            if clock.on:
                clock.totals[name] += elapsed
        handles.append(module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())))
        handles.append(module.register_forward_hook(done))

    attach(model.model.embed_tokens, "embedding")
    for layer in model.model.layers:
        attach(layer.input_layernorm, "norms")
        attach(layer.post_attention_layernorm, "norms")
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            attach(proj, "q/k/v projections")
        attach(layer.self_attn.o_proj, "output projection")
        attach(layer.mlp, "MLP")
    attach(model.model.norm, "norms")
    return handles


def profile(model, tokenizer: Tokenizer, batch: int, steps: int, clock: Clock, prompt_tokens: int,
            constrained: bool) -> tuple[dict[str, float], float, float]:
    num_kv_blocks = max(256, batch * (8 + prompt_tokens // 16))
    engine = build_engine(model, tokenizer, EngineConfig(num_kv_blocks=num_kv_blocks, max_num_seqs=batch,
                                                      max_num_batched_tokens=max(512, batch)))
    scheduler_schedule = engine.scheduler.schedule
    engine.scheduler.schedule = clock.wrap("schedule", scheduler_schedule)
    engine.runner.prepare_inputs = clock.wrap("prepare inputs", engine.runner.prepare_inputs)
    engine.runner.backend.forward = clock.wrap("attention", engine.runner.backend.forward)
    model.compute_logits = clock.wrap("lm_head", model.compute_logits)
    model.rotary.forward = clock.wrap("RoPE tables", model.rotary.forward)
    engine.sampler = clock.wrap("sampling", engine.sampler)
    decoder_step = StreamDecoder.step
    StreamDecoder.step = clock.wrap("detokenization", decoder_step)
    streams = {}
    try:
        for index in range(batch):
            prompt = tokenizer.encode(f"Story {index}: once upon a time")
            if prompt_tokens:
                prompt = (prompt + tokenizer.encode(LICENSE_TEXT))[:prompt_tokens]
            params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True,
                                    grammar=GRAMMAR if constrained else None)
            request_id = engine.add_request(prompt, params)
            request = parse_request({"type": "response.create", "input": "x"}, RESPONSES_WEBSOCKET, RequestLimits())
            streams[request_id] = ResponsesEvents(GenerationStream(request, params, request_id, "m", len(prompt),
                                                                   tokenizer.decode))
        while any(step.num_prefill_tokens for step in list(engine.step_history)[-1:]) or not engine.step_history:
            engine.step()  # prefill, outside the measurement
        clock.on = True
        engine.grammar_masks.timings.clear()
        start = time.perf_counter()
        for _ in range(steps):
            with clock.stage("step"):
                outputs = engine.step()
            with clock.stage("sending (events + JSON)"):
                for output in outputs:
                    view = streams[output.request_id]
                    view.stream.absorb(output)
                    for event in view.drain():
                        json.dumps(event)
        elapsed = time.perf_counter() - start
    finally:
        StreamDecoder.step = decoder_step
        del model.compute_logits, model.rotary.forward
    totals = dict(clock.totals)
    masks = list(engine.grammar_masks.timings)
    totals["grammar masks"] = sum(timing.wait_s + timing.apply_s for timing in masks)
    fill_s = percentile([timing.fill_s for timing in masks], 50) if masks else 0.0
    inner = sum(totals.get(name, 0.0) for name in STAGES if name not in ("other output path",
                                                                          "sending (events + JSON)"))
    # Stages nested in the model forward are disjoint; what the step spent outside all of them is the
    # output path (stop rules, bookkeeping, building RequestOutputs) plus the unhooked model glue.
    totals["other output path"] = max(0.0, totals.pop("step") - inner)
    return {name: totals.get(name, 0.0) / steps for name in STAGES}, elapsed / steps, fill_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="each prompt this long, license text after the story line (0: the story line alone)")
    parser.add_argument("--constrained", action="store_true", help="every request under a JSON-schema grammar")
    args = parser.parse_args()
    info = machine()
    print_machine(info)
    loaded = load_model(resolve_default_model(), dtype=getattr(torch, args.dtype))
    tokenizer = Tokenizer.from_gguf(loaded.gguf_reader)
    results = {}
    for batch in args.batches:
        clock = Clock()
        hooks = hook_modules(loaded.model, clock)
        try:
            per_stage, per_step, fill_s = profile(loaded.model, tokenizer, batch, args.steps, clock,
                                                     args.prompt_tokens, args.constrained)
        finally:
            for handle in hooks:
                handle.remove()
        results[batch] = {"per_step_s": per_step, "stages_s": per_stage, "mask_fill_s": fill_s}
    headers = ["stage"] + [f"{b} seq: ms/step (share)" for b in args.batches]
    rows = [[name] + [f"{results[b]['stages_s'][name] * 1000:.2f} "
                      f"({results[b]['stages_s'][name] / results[b]['per_step_s']:.0%})" for b in args.batches]
            for name in STAGES]
    rows.append(["**whole step + sending**"] + [f"{results[b]['per_step_s'] * 1000:.1f}" for b in args.batches])
    print()
    print(markdown_table(headers, rows))
    if args.constrained:
        print("\nmask fill on the worker, while the model runs (median ms/step): " + ", ".join(
            f"{b} seq: {results[b]['mask_fill_s'] * 1000:.2f}" for b in args.batches))
    name = "profile_step_constrained" if args.constrained else "profile_step"
    if args.dtype != "float32" or args.prompt_tokens:  # the documented run keeps its files
        name += f"_{args.dtype}_prompt{args.prompt_tokens}"
    png = bar_chart(DOCS / f"{name}.png", "Where a step's time goes (ms per step)", list(STAGES),
                    {f"{b} seq": [results[b]["stages_s"][name] * 1000 for name in STAGES] for b in args.batches},
                    "ms per step", log=True)
    print(f"\nplot: {png}; raw numbers: {save_raw(name, info, results)}")


if __name__ == "__main__":
    main()
