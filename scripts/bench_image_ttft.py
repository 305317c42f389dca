"""Images (issue 38): time to first token of a chat request with one image, cold and cached, through the real
server and the official `openai` SDK, streaming.

A random Gemma 3 vision model (transformers' `Gemma3Config` with a SigLIP vision config: a text model of hidden
512 x 8 layers, a SigLIP tower of hidden 384 x 6 layers over 448-pixel images in patches of 14 (1,024 patches),
pooled to 256 image tokens; saved with save_pretrained with the tokenizer, processor files and Gemma 3's chat
template of tests/helpers/vision_models.py: one token per character) is served by localserve's server on the
CPU, in this process (tests/helpers/server.py's `running_server`, prefix caching on, a whole prompt in one step).
The client is the `openai` SDK on the same machine: `chat.completions.create(stream=True)` with one user message
of [text, image (a 640 x 480 PNG data URL), question]; time to first token is from the call to the first chunk
carrying content (or the finish, when the first token is an end token: a random model may start with one).

Five cases, one after the other in each repeat (the cold case's picture is new in every repeat; the text-only
cases run first in even repeats and last in odd ones, so the machine's noise falls on all alike):
1. cold: a new picture, never seen (decode, preprocessing, the vision encoder, then the whole prompt's prefill);
2. the same request again: a prefix-cache hit up to the prompt's last whole block (usage's cached_tokens);
3. the same picture in another conversation (other text before it, as long): the embeddings cache gives the
   image's embeddings (no encoder run), but the prefix cache hits nothing past the chat template's first tokens,
   so the whole prompt is prefilled;
4. text only, as many prompt tokens as case 1's: the baseline of a prefill without an image;
5. the text-only request again: its prefix-cache hit, the baseline of case 2 (case 2 less case 5 is what a
   cached image still costs a request: its base64 and the file's hash, since the file's decoding and the
   model's preprocessing are remembered: server/request/image_cache.py).
Beside each: the prompt and cached tokens the server reported, and the deltas of /metrics' `images_encoded`,
`image_cache_hits` and `image_encode_seconds` around the request (per request, averaged over the repeats). TTFT
is the median of `--repeats`; the table gives each case's ratio to the cold case and to the text-only one.

`--dry-run`: a tiny model (image tokens 4, hidden 64 / 32), 2 repeats, the same path (for tests). Usage:
python scripts/bench_image_ttft.py [--repeats 5] [--threads 1] [--dry-run] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from benchlib import import_test_helpers, machine, markdown_table, print_machine, row_emitter

import_test_helpers()  # tests.helpers, without the repository root on sys.path

MODEL = {"text_hidden": 512, "text_intermediate": 2048, "text_layers": 8, "heads": 8, "kv_heads": 4,
         "head_dim": 64, "window": 512, "vision_hidden": 384, "vision_intermediate": 1536, "vision_layers": 6,
         "vision_heads": 6, "image_size": 448, "image_tokens": 256, "picture": (640, 480), "text_chars": 60}
DRY_MODEL = {"text_hidden": 64, "text_intermediate": 96, "text_layers": 2, "heads": 4, "kv_heads": 2,
             "head_dim": 16, "window": 16, "vision_hidden": 32, "vision_intermediate": 48, "vision_layers": 2,
             "vision_heads": 4, "image_size": 28, "image_tokens": 4, "picture": (40, 30), "text_chars": 20}
SERVED = "served"
BLOCK_SIZE = 16
QUESTION = "What is in this picture? Describe it in a few words."
CASES = ["1. cold: a new picture", "2. the same request again", "3. the same picture, another conversation",
         "4. text only, as many tokens", "5. the text-only request again"]
METRICS = ("images_encoded", "image_cache_hits", "image_encode_seconds")


def save_model(folder: Path, shape: dict) -> Path:
    """The random Gemma 3 vision model of `shape` (module doc) with its tokenizer, template and processor files."""
    import transformers

    from tests.helpers.gemma_models import gemma3_config
    from tests.helpers.vision_models import VOCAB_SIZE, write_tiny_gemma3_vision

    text = gemma3_config(vocab_size=VOCAB_SIZE, hidden_size=shape["text_hidden"],
                         intermediate_size=shape["text_intermediate"], num_hidden_layers=shape["text_layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         head_dim=shape["head_dim"], query_pre_attn_scalar=shape["head_dim"],
                         sliding_window=shape["window"])
    vision = transformers.SiglipVisionConfig(
        hidden_size=shape["vision_hidden"], intermediate_size=shape["vision_intermediate"],
        num_hidden_layers=shape["vision_layers"], num_attention_heads=shape["vision_heads"],
        image_size=shape["image_size"], patch_size=14)
    return write_tiny_gemma3_vision(folder, seed=0, text_config=text, vision_config=vision.to_dict(),
                                    mm_tokens_per_image=shape["image_tokens"])


@dataclass
class Sample:
    """One request: its time to first token, the tokens the server reported, the /metrics deltas around it."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    metrics: dict[str, float]


def image_counters(port: int) -> dict[str, float]:
    """The server's image counters (METRICS) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = dict.fromkeys(METRICS, 0.0)
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("localserve_")
        if name in values:
            values[name] += sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return values


def measure(sdk, port: int, content: list[dict]) -> Sample:
    """One streamed chat completion of a user message of `content` parts, one output token."""
    before = image_counters(port)
    start = time.perf_counter()
    stream = sdk.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": content}],
                                         max_tokens=1, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    first, usage = None, None
    for chunk in stream:
        if first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            first = time.perf_counter() - start
        usage = chunk.usage or usage
    after = image_counters(port)
    if first is None or usage is None:
        raise RuntimeError("the stream ended without a first token or without usage")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Sample(first, usage.prompt_tokens, cached, {name: after[name] - before[name] for name in METRICS})


def words(rng: random.Random, length: int) -> str:
    """Random lowercase words of exactly `length` characters (one token each), no space at either end."""
    letters = [rng.choice(string.ascii_lowercase) if i % 6 else " " for i in range(1, length + 1)]
    letters[0] = letters[-1] = rng.choice(string.ascii_lowercase)
    return "".join(letters)


def image_message(before: str, png: bytes) -> list[dict]:
    from tests.helpers.vision_models import data_url

    return [{"type": "text", "text": before}, {"type": "image_url", "image_url": {"url": data_url(png)}},
            {"type": "text", "text": QUESTION}]


def text_message(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


def run_cases(sdk, port: int, shape: dict, repeats: int) -> list[list[Sample]]:
    """Each case's samples (CASES' order) over `repeats` rounds, after a warm-up of one image and one text request
    (which also finds the text-only message's length that gives case 1's prompt tokens)."""
    from tests.helpers.pictures import picture
    from tests.helpers.vision_models import png_file

    rng = random.Random(0)
    width, height = shape["picture"]
    chars = shape["text_chars"]
    warm = measure(sdk, port, image_message(words(rng, chars), png_file(picture(width, height, seed=999))))
    probe = measure(sdk, port, text_message(words(rng, 50)))
    text_chars = warm.prompt_tokens - (probe.prompt_tokens - 50)  # the template's tokens around the text
    samples: list[list[Sample]] = [[] for _ in CASES]
    for repeat in range(repeats):
        png = png_file(picture(width, height, seed=repeat))
        cold_message = image_message(words(rng, chars), png)
        text_first = repeat % 2 == 0
        text = text_message(words(rng, text_chars))
        if text_first:
            samples[3].append(measure(sdk, port, text))
            samples[4].append(measure(sdk, port, text))
        samples[0].append(measure(sdk, port, cold_message))
        samples[1].append(measure(sdk, port, cold_message))
        samples[2].append(measure(sdk, port, image_message(words(rng, chars), png)))
        if not text_first:
            samples[3].append(measure(sdk, port, text))
            samples[4].append(measure(sdk, port, text))
    return samples


def per_request(case: list[Sample], metric: str) -> float:
    """A /metrics counter's delta per request of `case`."""
    return sum(sample.metrics[metric] for sample in case) / len(case)


def table_rows(samples: list[list[Sample]]) -> list[list[str]]:
    """One row per case: tokens, the /metrics deltas per request, median TTFT (min-max), its ratios."""
    medians = [statistics.median(sample.ttft_s for sample in case) for case in samples]
    rows = []
    for name, case, median in zip(CASES, samples, medians):
        prompt = sorted({sample.prompt_tokens for sample in case})
        cached = sorted({sample.cached_tokens for sample in case})
        times = [sample.ttft_s * 1e3 for sample in case]
        rows.append([name, "/".join(f"{value:,}" for value in prompt), "/".join(f"{value:,}" for value in cached),
                     f"{per_request(case, 'images_encoded'):g}", f"{per_request(case, 'image_cache_hits'):g}",
                     f"{per_request(case, 'image_encode_seconds') * 1e3:.0f}", f"{median * 1e3:.0f}",
                     f"{min(times):.0f}-{max(times):.0f}", f"{medians[0] / median:.1f}x",
                     f"{median / medians[3]:.2f}x"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="TTFT: the median of this many runs of each case")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, 2 repeats")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    shape = DRY_MODEL if args.dry_run else MODEL
    if args.dry_run:
        args.repeats = 2
    from localserve.engine.config import EngineConfig
    from localserve.llm import LLM
    from tests.helpers.server import openai_client, running_server

    emit = row_emitter(args.out)
    config = EngineConfig(num_kv_blocks=512, max_num_seqs=2, max_num_batched_tokens=1024, block_size=BLOCK_SIZE,
                          enable_prefix_caching=True)  # a whole prompt in one step: TTFT is its prefill
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(str(save_model(Path(folder), shape)), device="cpu", dtype=torch.float32, engine_config=config)
        with running_server(llm, model_alias=SERVED) as server, openai_client(server.port, timeout=600) as sdk:
            torch.set_num_threads(args.threads)  # running_server sets 1; the engine thread reads it at its first op
            info = machine()
            print_machine(info)
            started = time.perf_counter()
            samples = run_cases(sdk, server.port, shape, args.repeats)
    emit([f"Gemma 3 random: text hidden {shape['text_hidden']} x {shape['text_layers']} layers, SigLIP hidden "
          f"{shape['vision_hidden']} x {shape['vision_layers']} layers, {shape['image_size']} px in patches of 14 "
          f"-> {shape['image_tokens']} image tokens; float32, CPU, {info['torch_threads']} torch threads; "
          f"{shape['picture'][0]} x {shape['picture'][1]} PNG; median of {args.repeats} repeats "
          f"({time.perf_counter() - started:.0f} s in all); machine: {info['cpu']}, {info['cores']} cores, "
          f"torch {info['torch']}, {info['date']}", "",
          markdown_table(["case", "prompt tokens", "cached tokens", "images encoded", "embeddings cache hits",
                          "encoder (ms)", "TTFT (ms)", "min-max (ms)", "cold / case", "case / text only"],
                         table_rows(samples)), ""])


if __name__ == "__main__":
    main()
