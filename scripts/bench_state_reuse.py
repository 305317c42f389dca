"""Prefix reuse of a hybrid linear-attention model across chat turns (issue 37): time to first token per
turn with the prefix cache on and off, side by side in one run, and the checkpoint interval's trade-off.

A small random Qwen3.5 (transformers' `Qwen3_5TextConfig`: hidden 512, 8 layers of which 2 full attention and
6 Gated DeltaNet, saved with save_pretrained into a temporary folder and loaded by localserve) runs a
10-turn conversation on LLMEngine directly, on the CPU. Every turn resends the whole history as Qwen3.5's
chat template renders it: each past turn is `<|im_start|>user\\n` + ~100 new tokens + `<|im_end|>\\n` and
`<|im_start|>assistant\\n` + the answer (the engine's own 32 greedy tokens) + `<|im_end|>\\n`; the prompt ends
with the generation prompt `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n` (thinking off), whose last four
tokens the next turn renders differently (a past answer has no think block). Token ids stand for those
pieces (ids 1-9 the markers, the rest random words), so no tokenizer is needed.

Table 1, one row per turn: the prompt's tokens, the tokens the reuse engine served from the cache (its
`num_cached_tokens`), its time to first token (add_request to the first output token: the prefill of the
tokens past the cached boundary), the same prompt's on an engine with prefix caching off (the whole prompt
prefilled), their ratio, and whether both answered the same. Times are medians of `--repeats` runs: the
turn itself and its prompt with other words in the new message (as long; they resume from the same
checkpoint). The two engines take turns, so the machine's noise falls on both alike.

Table 2, the checkpoint interval (`state_checkpoint_tokens`): the same conversation on engines checkpointing
every 512 (the default), 128 and 32 tokens: tokens recomputed per turn (prompt - cached) and the checkpoints
the state pool holds at the end (each one a state of every linear layer: `slot` bytes). A checkpoint sits at
every interval and at each prompt's last block boundary; a turn resumes from the previous prompt's last
boundary unless that boundary lies inside the four tokens the next turn renders differently (the previous
prompt's length mod 16 below 4), when it falls back to the nearest earlier checkpoint: a shorter interval
bounds that fall-back at the price of more states kept.

`--dry-run`: a tiny model, 3 short turns, the same path (for tests). Usage: python scripts/bench_state_reuse.py
[--turns 10] [--new-tokens 100] [--answer-tokens 32] [--intervals 512,128,32] [--repeats 3] [--threads 1]
[--dry-run] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from benchlib import machine, markdown_table, print_machine, row_emitter

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model

BLOCK_SIZE = 16
IM_START, IM_END, NL, USER, ASSISTANT, THINK, END_THINK, NL2 = 1, 2, 3, 4, 5, 6, 7, 8
GENERATION_PROMPT = [IM_START, ASSISTANT, NL, THINK, NL2, END_THINK, NL2]  # ends `<think>\n\n</think>\n\n`
FIRST_WORD = 16  # ids below are markers
MODEL = {"hidden_size": 512, "intermediate_size": 1536, "layers": 8, "vocab_size": 8192}
DRY_MODEL = {"hidden_size": 64, "intermediate_size": 96, "layers": 4, "vocab_size": 512}


def save_model(folder: Path, hidden_size: int, intermediate_size: int, layers: int, vocab_size: int) -> Path:
    """A random Qwen3.5 text model (transformers' own init), every fourth layer full attention, saved with
    save_pretrained."""
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=8192, bos_token_id=IM_START, eos_token_id=IM_END,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@dataclass
class Turn:
    prompt: int
    cached: int
    ttft_s: float
    answer: list[int]


def run_turn(engine, prompt: list[int], answer_tokens: int) -> Turn:
    """One request alone on `engine`, stepped to its end: its cached tokens, time to first token, answer."""
    params = SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    first, final = None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter() - start
            if output.finished:
                final = output
    return Turn(len(prompt), final.num_cached_tokens, first, list(final.outputs[0].token_ids))


class Conversation:
    """A chat's token ids as Qwen3.5's template renders it (module doc); answers are added as they come."""

    def __init__(self, new_tokens: int, vocab_size: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.new_tokens, self.vocab_size = new_tokens, vocab_size
        self.history: list[int] = []

    def ask(self) -> list[int]:
        """The next turn's prompt: the history, a new user message of about `new_tokens`, the generation prompt."""
        self.length = self.new_tokens + self.rng.randint(-self.new_tokens // 4, self.new_tokens // 4)
        self.asked = self.history[:]
        self.history += self.message()
        return self.history + GENERATION_PROMPT

    def other_asks(self, count: int) -> list[list[int]]:
        """`count` prompts like the last one but with other words in its new message (as long): they share
        what it shares with the earlier turns, and resume from the same checkpoint."""
        return [self.asked + self.message() + GENERATION_PROMPT for _ in range(count)]

    def message(self) -> list[int]:
        words = [self.rng.randrange(FIRST_WORD, self.vocab_size) for _ in range(self.length)]
        return [IM_START, USER, NL, *words, IM_END, NL]

    def answer(self, tokens: list[int]) -> None:
        self.history += [IM_START, ASSISTANT, NL, *tokens, IM_END, NL]


def median_ttft(on, off, first: tuple[Turn, Turn], others: list[list[int]]) -> tuple[float, float]:
    """The median time to first token on the engines `on` (cache) and `off` of a turn (`first`: its runs) and
    of `others` (its prompt with other words in the new message, one output token each), taking turns."""
    times_on, times_off = [first[0].ttft_s], [first[1].ttft_s]
    for prompt in others:
        again = run_turn(on, prompt, 1)
        if again.cached != first[0].cached:
            print(f"note: a repeat resumed from {again.cached}, the turn from {first[0].cached}")
        times_on.append(again.ttft_s)
        times_off.append(run_turn(off, prompt, 1).ttft_s)
    return statistics.median(times_on), statistics.median(times_off)


def engine_for(model, caching: bool, interval: int, chunk: int):
    return build_engine(model, None, EngineConfig(num_kv_blocks=512, max_num_seqs=2, max_num_batched_tokens=chunk,
                                                  enable_prefix_caching=caching, state_checkpoint_tokens=interval))


def state_pool(engine) -> tuple[int, int, int, int]:
    """(checkpoints cached now, checkpoints evicted so far, pool slots, bytes of one slot) of the state group."""
    manager = engine.block_manager
    pool = manager._pools[manager.state_group]  # the books have no public per-group counters
    slot_bytes = engine.runner.kv_cache.states.slot_bytes
    return pool.num_cached_blocks, pool.cached_block_evictions, pool.num_blocks, slot_bytes


def warm_up(engine, vocab_size: int) -> None:
    """One unrelated request: the first step's one-off costs stay out of turn 1."""
    rng = random.Random(99)
    run_turn(engine, [rng.randrange(FIRST_WORD, vocab_size) for _ in range(40)], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--intervals", default="512,128,32", help="state_checkpoint_tokens values of table 2")
    parser.add_argument("--repeats", type=int, default=3, help="TTFT: the median of this many runs of each turn")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, 3 short turns")
    parser.add_argument("--out", type=Path, help="also write the tables here")
    args = parser.parse_args()
    shape = DRY_MODEL if args.dry_run else MODEL
    if args.dry_run:
        args.turns, args.new_tokens, args.answer_tokens, args.intervals, args.repeats = 3, 20, 4, "512,32", 2
    intervals = [int(value) for value in args.intervals.split(",")]
    torch.set_num_threads(args.threads)
    info = machine()
    print_machine(info)
    emit = row_emitter(args.out)
    with tempfile.TemporaryDirectory() as folder:
        model = load_model(save_model(Path(folder), **shape), dtype=torch.float32, device="cpu").model
    chunk = 8192  # a turn's prompt in one step: time to first token is its prefill
    on, off = engine_for(model, True, intervals[0], chunk), engine_for(model, False, intervals[0], chunk)
    for engine in (on, off):
        warm_up(engine, shape["vocab_size"])
    conversation, prompts, rows = Conversation(args.new_tokens, shape["vocab_size"]), [], []
    for turn in range(1, args.turns + 1):
        prompt = conversation.ask()
        prompts.append(prompt)
        with_cache, without = run_turn(on, prompt, args.answer_tokens), run_turn(off, prompt, args.answer_tokens)
        ttft_on, ttft_off = median_ttft(on, off, (with_cache, without), conversation.other_asks(args.repeats - 1))
        conversation.answer(with_cache.answer)
        rows.append([turn, f"{with_cache.prompt:,}", f"{with_cache.cached:,}",
                     f"{with_cache.prompt - with_cache.cached:,}", f"{ttft_on * 1e3:.0f}", f"{ttft_off * 1e3:.0f}",
                     f"{ttft_off / ttft_on:.1f}x", "yes" if with_cache.answer == without.answer else "NO"])
    layers = sum(1 for kind in model.config.layer_attention if kind.state is not None)
    emit([f"Qwen3.5 random, hidden {shape['hidden_size']}, {shape['layers']} layers ({shape['layers'] - layers} "
          f"full attention, {layers} Gated DeltaNet), float32, CPU, {torch.get_num_threads()} torch threads; "
          f"state_checkpoint_tokens {intervals[0]}; answers {args.answer_tokens} greedy tokens", "",
          markdown_table(["turn", "prompt tokens", "cached tokens", "prefilled", "TTFT on (ms)", "TTFT off (ms)",
                          "off / on", "same answer"], rows), ""])
    # Table 2: the same prompts (answers are greedy: the same on every engine) at each interval.
    recomputed, pools = {}, {}
    for interval in intervals:
        engine = engine_for(model, True, interval, chunk)
        turns = [run_turn(engine, prompt, args.answer_tokens) for prompt in prompts]
        recomputed[interval] = [turn.prompt - turn.cached for turn in turns]
        pools[interval] = state_pool(engine)
    rows = [[turn + 1, f"{len(prompts[turn]):,}", *(f"{recomputed[i][turn]:,}" for i in intervals)]
            for turn in range(len(prompts))]
    rows.append(["total", f"{sum(map(len, prompts)):,}", *(f"{sum(recomputed[i]):,}" for i in intervals)])
    cached_row = ["checkpoints cached at the end", "", *(f"{pools[i][0]} ({pools[i][1]} evicted)" for i in intervals)]
    slot_bytes = pools[intervals[0]][3]
    memory_row = ["their memory (MiB)", "", *(f"{pools[i][0] * slot_bytes / 2**20:.2f}" for i in intervals)]
    emit([f"Tokens prefilled per turn (prompt - cached) at each state_checkpoint_tokens; one checkpoint (state of "
          f"{layers} layers) = {slot_bytes / 2**20:.2f} MiB here", "",
          markdown_table(["turn", "prompt tokens", *(f"every {i}" for i in intervals)],
                         rows + [cached_row, memory_row]), ""])


if __name__ == "__main__":
    main()
