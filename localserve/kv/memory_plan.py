"""Memory planning: KV bytes per token per format, blocks that fit a budget, and `localserve plan`.

Everything is computed from the model's real shapes (layers, KV heads, head_dim) and each format's
exact storage layout, so the plan and the pool the engine allocates agree byte for byte. Sizes such as
`24GB` are read as binary units (GiB): that is what a "24 GB" card has.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from localserve.kv.formats import bits_per_value, canonical_format, make_codec
from localserve.models.config import ModelConfig

DEFAULT_UTILIZATION = 0.9
PLAN_FORMATS = (("fp16", "fp16"), ("q8_0", "q8_0"), ("q8_0", "q4_rot"), ("q4_rot", "q4_rot"))
CONTEXTS = (8192, 32768)
_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


def parse_size(text: str) -> int:
    """'24GB', '24GiB', '24g', '512MB', '1e9' -> bytes (K/M/G/T are binary multiples)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 24GB, 8GiB, 512MB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def kv_bytes_per_token(config: ModelConfig, cache_type_k: str, cache_type_v: str) -> int:
    """Bytes one token's K and V take in the pool, all layers, in formats cache_type_k / cache_type_v."""
    key = make_codec(cache_type_k, "key", config.num_kv_heads, config.head_dim)
    value = make_codec(cache_type_v, "value", config.num_kv_heads, config.head_dim)
    return config.num_layers * (key.bytes_per_token() + value.bytes_per_token())


def num_kv_blocks(kv_budget_bytes: int, bytes_per_token: int, block_size: int = 16) -> int:
    """Whole blocks of `block_size` tokens that fit in `kv_budget_bytes`."""
    return max(0, kv_budget_bytes // (bytes_per_token * block_size))


def kv_budget_bytes(total_memory: int, weight_bytes: int, utilization: float = DEFAULT_UTILIZATION,
                    reserve_bytes: int = 0) -> int:
    """What is left for the KV pool: `utilization` of the device, less weights and a reserve."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    return max(0, int(total_memory * utilization) - weight_bytes - reserve_bytes)


def blocks_for_device(config: ModelConfig, cache_type_k: str, cache_type_v: str, block_size: int,
                      weight_bytes: int, total_memory: int | None = None,
                      utilization: float = DEFAULT_UTILIZATION, kv_budget: int | None = None,
                      reserve_bytes: int = 0) -> int:
    """Number of KV blocks from an explicit byte budget, else from the device memory and utilization."""
    if kv_budget is None:
        if total_memory is None:
            raise ValueError("give either a KV byte budget or the device memory")
        kv_budget = kv_budget_bytes(total_memory, weight_bytes, utilization, reserve_bytes)
    return num_kv_blocks(kv_budget, kv_bytes_per_token(config, cache_type_k, cache_type_v), block_size)


def estimated_weight_bytes(config: ModelConfig, bytes_per_param: float = 2.0) -> int:
    """Weights of a Llama-family model from its shapes (16-bit by default); for a bare config.json."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * q * 2 + h * kv * 2 + 3 * h * config.intermediate_size + 2 * h
    if config.qkv_bias:
        per_layer += q + 2 * kv
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return int((config.num_layers * per_layer + embeddings + h) * bytes_per_param)


def load_plan_model(model: str | None, bytes_per_param: float = 2.0,
                    keep_quantized_weights: bool = True) -> tuple[ModelConfig, int, str]:
    """(config, weight bytes once loaded, how they were counted) for a config.json, an HF folder or a .gguf
    file; None: the default model.

    Reads only metadata. Weights count at `bytes_per_param` (bf16 on a GPU), except a GGUF's tensors
    that --keep-quantized-weights keeps in their blocks, which count at their stored size (the loader's
    own rule, `keeps_quantized`).
    """
    if model is None:
        from localserve.loading.default_model import resolve_default_model

        path = resolve_default_model()
    else:
        path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    dense = f"parameters x {bytes_per_param:g} bytes"
    if path.is_file() and path.suffix == ".json":
        name = path.parent.name if path.name == "config.json" else path.stem
        config = ModelConfig.from_hf_config(json.loads(path.read_text()), name=name, source=str(path))
        return config, estimated_weight_bytes(config, bytes_per_param), dense
    if path.is_file() and path.suffix == ".gguf":
        from localserve.loading.gguf import gguf_model_config, gguf_weight_bytes, open_gguf

        reader = open_gguf(path)
        config = gguf_model_config(path, reader)
        stored, dense_bytes = gguf_weight_bytes(reader, bytes_per_param)
        if keep_quantized_weights and stored < dense_bytes:
            return config, stored, f"stored size, quantized blocks kept; {human_size(dense_bytes)} at {dense}"
        return config, dense_bytes, dense
    raise ValueError(f"{model}: not a config.json, a model folder or a .gguf file")


@dataclass
class PlanRow:
    """One line of the plan: a K/V format pair and what fits."""

    cache_type_k: str
    cache_type_v: str
    bits_k: float
    bits_v: float
    bytes_per_token: int
    tokens: int  # whole blocks' worth
    sequences: dict[int, int]  # context length -> sequences that fit at that length

    @property
    def label(self) -> str:
        if self.cache_type_k == self.cache_type_v:
            return self.cache_type_k
        return f"K {self.cache_type_k} / V {self.cache_type_v}"


def plan(config: ModelConfig, kv_budget: int, block_size: int = 16,
         formats: tuple[tuple[str, str], ...] = PLAN_FORMATS,
         contexts: tuple[int, ...] = CONTEXTS) -> list[PlanRow]:
    """What fits in `kv_budget` bytes of KV pool for each (K format, V format)."""
    rows = []
    for k_type, v_type in formats:
        k_type, v_type = canonical_format(k_type), canonical_format(v_type)
        per_token = kv_bytes_per_token(config, k_type, v_type)
        tokens = num_kv_blocks(kv_budget, per_token, block_size) * block_size
        seqs = {ctx: tokens // ctx for ctx in contexts}
        rows.append(PlanRow(k_type, v_type, bits_per_value(k_type, config.head_dim),
                            bits_per_value(v_type, config.head_dim), per_token, tokens, seqs))
    return rows


def human_size(n: float) -> str:
    """Bytes in binary units: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_plan(rows: list[PlanRow], contexts: tuple[int, ...] = CONTEXTS) -> str:
    """The plan as a Markdown table (like DESIGN.md section 3)."""
    base = rows[0].tokens or 1
    header = ["format", "bits/value (K, V)", "bytes/token", "tokens that fit", "vs first row"]
    header += [f"seqs @ {c // 1024}K" for c in contexts]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row.label, f"{row.bits_k:g}, {row.bits_v:g}",
                 f"{row.bytes_per_token:,} ({human_size(row.bytes_per_token)})", f"{row.tokens:,}",
                 f"{row.tokens / base:.2f}x"]
        cells += [str(row.sequences[c]) for c in contexts]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tokens_ratio(rows: list[PlanRow], label: str) -> float:
    """Tokens of the row `label` over the first row's (for tests and reports)."""
    row = next(r for r in rows if r.label == label)
    return row.tokens / max(1, rows[0].tokens)



def engine_num_kv_blocks(model, cache_type_k: str | None, cache_type_v: str | None, block_size: int,
                         kv_budget: int | None = None, utilization: float | None = None) -> int:
    """KV blocks for a loaded model: from an explicit byte budget, else from the CUDA device's memory.

    With `utilization`, the pool gets utilization x the device's memory less what is already allocated
    (the weights). Unset K/V formats mean the model's dtype, as in the engine.
    """
    import torch

    from localserve.kv.formats import dtype_format

    param = next(model.parameters())
    default = dtype_format(param.dtype)
    per_token = kv_bytes_per_token(model.config, cache_type_k or default, cache_type_v or default)
    if kv_budget is None:
        if param.device.type != "cuda":
            raise ValueError("--gpu-memory-utilization needs a CUDA device; give a KV budget in bytes instead")
        total = torch.cuda.get_device_properties(param.device).total_memory
        kv_budget = kv_budget_bytes(total, torch.cuda.memory_allocated(param.device),
                                    utilization or DEFAULT_UTILIZATION)
    blocks = num_kv_blocks(kv_budget, per_token, block_size)
    if blocks == 0:
        raise ValueError(f"a KV budget of {human_size(kv_budget)} holds no block of {block_size} tokens "
                         f"({human_size(per_token * block_size)} each)")
    return blocks
