"""KV-cache quality: next-token distributions through each KV format against the fp16 cache.

Protocol (as llama.cpp's perplexity tool): SmolLM2-135M-Instruct in float32, real English text (the GPL-3,
Apache-2.0, MPL-2.0 and LGPL-2.1 texts of /usr/share/common-licenses, concatenated), 16 chunks of 512
tokens, each run as one prompt through the paged cache (every key and value read back from the cache,
its own included), scoring the second half of each chunk. Per format: bits per value, perplexity and its
ratio to the reference, mean and p99 KL divergence from the reference, and top-1 agreement. The 4-bit
format is also run with each technique switched off in turn.

    python scripts/kv_quality.py [--chunks 16] [--ctx 512] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from localserve.models.protocol import ForwardContext

from localserve.attention.base import AttentionInputs
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.engine.builder import build_kv_cache
from localserve.kv.cache import PagedKVCache
from localserve.kv.formats import KVFormatSpec

LICENSES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1")
REFERENCE = ("fp16", "fp16")
CONFIGS = [  # (label, K format, V format)
    ("bf16", "bf16", "bf16"),
    ("q8_0", "q8_0", "q8_0"),
    ("q8_0, no rotation (llama.cpp's q8_0)", "q8_0:-rotation", "q8_0:-rotation"),
    ("q4_rot", "q4_rot", "q4_rot"),
    ("K q8_0 / V q4_rot", "q8_0", "q4_rot"),
    ("K q8_0 (no rotation) / V q4_rot", "q8_0:-rotation", "q4_rot"),
    ("q4_rot, no rotation", "q4_rot:-rotation", "q4_rot:-rotation"),
    ("q4_rot, uniform levels + absmax scale", "q4_rot:-codebook", "q4_rot:-codebook"),
    ("q4_rot, no mean", "q4_rot:-mean", "q4_rot:-mean"),
    ("q4_rot, no key transform", "q4_rot:-key_transform", "q4_rot:-key_transform"),
    ("plain 4-bit (all off)", "q4_rot:-rotation,-codebook,-mean,-key_transform",
     "q4_rot:-rotation,-codebook,-mean,-key_transform"),
]


def load_text(folder: Path = Path("/usr/share/common-licenses")) -> str:
    return "\n\n".join((folder / name).read_text() for name in LICENSES)


@torch.inference_mode()
def scored_logprobs(model, cache: PagedKVCache, tokens: list[int], first: int) -> torch.Tensor:
    """Log-probabilities [len(tokens) - 1 - first, vocab] predicting tokens first+1 .. end (one prompt)."""
    n, block = len(tokens), cache.block_size
    inputs = AttentionInputs.for_prompt(n, list(range(-(-n // block))), block, "cpu")
    backend = TorchAttentionBackend()
    context = ForwardContext(backend, cache, backend.build_metadata(inputs))
    hidden = model(torch.tensor(tokens), inputs.positions, context)
    return model.compute_logits(hidden[first:n - 1]).log_softmax(-1)


def format_bits(spec: str, head_dim: int) -> float:
    return KVFormatSpec.parse(spec).bits_per_value(head_dim)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--only", nargs="*", help="labels of CONFIGS to run (default: all)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)

    from localserve.loading.default_model import resolve_default_model
    from localserve.loading.hf import load_model
    from localserve.tokenizer.tokenizer import Tokenizer

    path = resolve_default_model()
    loaded = load_model(path, dtype=torch.float32)
    model, config = loaded.model, loaded.config
    tokenizer = Tokenizer.from_path(path)
    tokens = tokenizer.encode(load_text())
    if len(tokens) < args.chunks * args.ctx:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than {args.chunks} x {args.ctx}")
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only]
    num_blocks = -(-args.ctx // 16)

    def make_cache(k: str, v: str) -> PagedKVCache:
        return build_kv_cache(model, tokenizer, KVFormatSpec.parse(k), KVFormatSpec.parse(v), num_blocks, 16)

    caches = {label: make_cache(k, v) for label, k, v in configs}  # calibrates once, before timing
    reference_cache = make_cache(*REFERENCE)
    first = args.ctx // 2
    stats = {label: {"kl": [], "nll": [], "agree": []} for label, _, _ in configs}
    ref_nll: list[torch.Tensor] = []
    started = time.time()
    for chunk in range(args.chunks):
        ids = tokens[chunk * args.ctx:(chunk + 1) * args.ctx]
        targets = torch.tensor(ids[first + 1:])
        ref = scored_logprobs(model, reference_cache, ids, first)
        ref_nll.append(-ref.gather(1, targets[:, None])[:, 0])
        for label, _, _ in configs:
            out = scored_logprobs(model, caches[label], ids, first)
            stats[label]["kl"].append((ref.exp() * (ref - out)).sum(-1))
            stats[label]["nll"].append(-out.gather(1, targets[:, None])[:, 0])
            stats[label]["agree"].append((out.argmax(-1) == ref.argmax(-1)).float())
        print(f"chunk {chunk + 1}/{args.chunks} done, {time.time() - started:.0f}s", file=sys.stderr,
              flush=True)

    ref_ppl = torch.cat(ref_nll).mean().exp().item()
    lines = [f"SmolLM2-135M-Instruct (float32), {args.chunks} x {args.ctx} tokens of license text, second "
             f"half of each chunk scored; reference: fp16 cache, PPL {ref_ppl:.4f}.", "",
             "| KV format (K / V) | bits/value (K, V) | PPL | PPL ratio | mean KLD | p99 KLD | top-1 agree |",
             "|---|---|---|---|---|---|---|"]
    for label, k, v in configs:
        kl = torch.cat(stats[label]["kl"]).clamp_min(0)
        ppl = torch.cat(stats[label]["nll"]).mean().exp().item()
        agree = torch.cat(stats[label]["agree"]).mean().item()
        bits = f"{format_bits(k, config.head_dim):g}, {format_bits(v, config.head_dim):g}"
        lines.append(f"| {label} | {bits} | {ppl:.4f} | {ppl / ref_ppl:.4f} | {kl.mean().item():.5f} | "
                     f"{torch.quantile(kl, 0.99).item():.4f} | {100 * agree:.2f}% |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
