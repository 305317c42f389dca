"""Where the time of one decode step goes, at 1, 32 and 128 running sequences (SmolLM2, CPU).

Each stage is timed in place during real engine steps (wrappers on the engine's parts and forward
hooks on the model's modules; on the CPU every operation has finished when it returns): scheduling,
building the step's tensors, the model forward split by layer part (embedding, norms, q/k/v
projections with RoPE, attention including the KV write, output projection, MLP, final norm and
lm_head), sampling, detokenization, the rest of the output path, and what sending costs the server
(building the response events of the step's outputs and their JSON). Prints a table of milliseconds
per step and shares of the step.

    python scripts/profile_step.py [--batches 1 32 128] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from benchlib import DOCS, bar_chart, machine, markdown_table, print_machine, save_raw

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.default_model import resolve_default_model
from localserve.loading.hf import load_model
from localserve.server.request_fields import parse_request
from localserve.server.request_model import RequestLimits
from localserve.server.response_events import ResponseStream
from localserve.server.responses_format import RESPONSES_WEBSOCKET
from localserve.tokenizer.tokenizer import StreamDecoder, Tokenizer

STAGES = ("schedule", "prepare inputs", "embedding", "norms", "q/k/v projections", "RoPE tables", "attention",
          "output projection", "MLP", "lm_head", "sampling", "detokenization", "other output path",
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


def profile(model, tokenizer: Tokenizer, batch: int, steps: int, clock: Clock) -> tuple[dict[str, float], float]:
    engine = build_engine(model, tokenizer, EngineConfig(num_kv_blocks=max(256, batch * 8), max_num_seqs=batch,
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
            params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
            request_id = engine.add_request(prompt, params)
            request = parse_request({"type": "response.create", "input": "x"}, RESPONSES_WEBSOCKET, RequestLimits())
            streams[request_id] = ResponseStream(request, params, request_id, "m", len(prompt), tokenizer.decode)
        while any(step.num_prefill_tokens for step in list(engine.step_history)[-1:]) or not engine.step_history:
            engine.step()  # prefill, outside the measurement
        clock.on = True
        start = time.perf_counter()
        for _ in range(steps):
            with clock.stage("step"):
                outputs = engine.step()
            with clock.stage("sending (events + JSON)"):
                for output in outputs:
                    stream = streams[output.request_id]
                    stream.absorb(output)
                    for event in stream.drain():
                        json.dumps(event)
        elapsed = time.perf_counter() - start
    finally:
        StreamDecoder.step = decoder_step
        del model.compute_logits, model.rotary.forward
    totals = dict(clock.totals)
    inner = sum(totals.get(name, 0.0) for name in STAGES if name not in ("other output path",
                                                                          "sending (events + JSON)"))
    # Stages nested in the model forward are disjoint; what the step spent outside all of them is the
    # output path (stop rules, bookkeeping, building RequestOutputs) plus the unhooked model glue.
    totals["other output path"] = max(0.0, totals.pop("step") - inner)
    return {name: totals.get(name, 0.0) / steps for name in STAGES}, elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    info = machine()
    print_machine(info)
    loaded = load_model(resolve_default_model(), dtype=torch.float32)
    tokenizer = Tokenizer.from_gguf(loaded.gguf_reader)
    results = {}
    for batch in args.batches:
        clock = Clock()
        hooks = hook_modules(loaded.model, clock)
        try:
            per_stage, per_step = profile(loaded.model, tokenizer, batch, args.steps, clock)
        finally:
            for handle in hooks:
                handle.remove()
        results[batch] = {"per_step_s": per_step, "stages_s": per_stage}
    headers = ["stage"] + [f"{b} seq: ms/step (share)" for b in args.batches]
    rows = [[name] + [f"{results[b]['stages_s'][name] * 1000:.2f} "
                      f"({results[b]['stages_s'][name] / results[b]['per_step_s']:.0%})" for b in args.batches]
            for name in STAGES]
    rows.append(["**whole step + sending**"] + [f"{results[b]['per_step_s'] * 1000:.1f}" for b in args.batches])
    print()
    print(markdown_table(headers, rows))
    png = bar_chart(DOCS / "profile_step.png", "Where a step's time goes (ms per step)", list(STAGES),
                    {f"{b} seq": [results[b]["stages_s"][name] * 1000 for name in STAGES] for b in args.batches},
                    "ms per step", log=True)
    print(f"\nplot: {png}; raw numbers: {save_raw('profile_step', info, results)}")


if __name__ == "__main__":
    main()
