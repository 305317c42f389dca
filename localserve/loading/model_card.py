"""What clients are told about the served model's files and shape: where it came from, its format,
family, size in parameters and bytes, its quantization, read once at start (no torch here).

Ollama's `/api/tags`, `/api/show` and `/api/ps` and llama.cpp's `/props` read it. The `digest` names the
files (their names, sizes and times), not a hash of their contents: hashing gigabytes at every start
would delay it by seconds, and no client checks the digest against the bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from localserve.models.config import ModelConfig

# Hugging Face architecture -> the family name GGUF metadata (and so Ollama) uses
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "Phi3ForCausalLM": "phi3",
            "Mistral3ForConditionalGeneration": "mistral3", "Ministral3ForCausalLM": "mistral3"}
WEIGHT_SUFFIXES = (".safetensors", ".gguf")


@dataclass(frozen=True)
class ModelCard:
    """The served model as its files and config describe it; `ModelCard()` knows nothing (a test's)."""

    path: str = ""
    format: str = ""  # "gguf" or "safetensors"
    family: str = ""
    parameter_count: int = 0
    active_parameter_count: int = 0  # read for each token: a mixture of experts' chosen experts only
    architecture: str = ""  # the Hugging Face architecture it is served as ("Qwen3MoeForCausalLM")
    quantization: str = ""  # "Q4_1", "BF16", ...
    size_bytes: int = 0  # of the weight files
    modified_at: str = "1970-01-01T00:00:00Z"
    digest: str = ""
    model_info: tuple[tuple[str, Any], ...] = ()  # GGUF-style keys: general.architecture, llama.block_count, ...

    @classmethod
    def read(cls, path: str | Path, config: ModelConfig) -> ModelCard:
        """The card of the model in `path` (a folder or a .gguf file) whose config is `config`."""
        path = Path(path)
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
        stats = [(file.name, file.stat()) for file in files]
        naming = "\n".join(f"{name} {stat.st_size} {stat.st_mtime_ns}" for name, stat in stats)
        newest = max((stat.st_mtime for _, stat in stats), default=0.0)
        family = FAMILIES.get(config.architecture, config.architecture)
        count, active = parameter_count(config), parameter_count(config, active=True)
        info = {"general.architecture": family, "general.parameter_count": count,
                "general.active_parameter_count": active,
                f"{family}.context_length": config.context_length, f"{family}.embedding_length": config.hidden_size,
                f"{family}.feed_forward_length": config.intermediate_size, f"{family}.block_count": config.num_layers,
                f"{family}.attention.head_count": config.num_heads,
                f"{family}.attention.head_count_kv": config.num_kv_heads,
                f"{family}.attention.key_length": config.head_dim,
                f"{family}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
                f"{family}.rope.freq_base": config.rope.theta, f"{family}.vocab_size": config.vocab_size}
        if config.moe is not None:
            info |= {f"{family}.expert_count": config.moe.num_experts,
                     f"{family}.expert_used_count": config.moe.top_k,
                     f"{family}.expert_feed_forward_length": config.moe.intermediate_size}
        return cls(path=str(path), format="gguf" if path.suffix == ".gguf" else "safetensors", family=family,
                   parameter_count=count, active_parameter_count=active, architecture=config.architecture,
                   quantization=_quantization(path), size_bytes=sum(s.st_size for _, s in stats),
                   modified_at=datetime.fromtimestamp(newest, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   digest=hashlib.sha256(naming.encode()).hexdigest(), model_info=tuple(info.items()))

    @property
    def parameter_size(self) -> str:
        """The parameter count as Ollama writes it: "135.0M", "8.0B"."""
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if self.parameter_count >= scale:
                return f"{self.parameter_count / scale:.1f}{unit}"
        return str(self.parameter_count)


def parameter_count(config: ModelConfig, active: bool = False) -> int:
    """The parameters of a decoder of this shape: embeddings, each layer's attention, MLP (or router, experts
    and shared expert) and norms, the final norm, and the output head unless it is tied to the embeddings.

    `active`: those read for one token: of the routed experts, only the k chosen (Qwen3-30B-A3B: 30.5B,
    3.3B active; embeddings counted in both, as their makers count them)."""
    hidden, heads = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    attention = hidden * (heads + 2 * kv) + heads * hidden
    if config.qkv_bias:
        attention += heads + 2 * kv
    if config.o_bias:
        attention += hidden
    if config.qk_norm:
        attention += 2 * config.head_dim
    if config.linear_attention is not None:  # a hybrid model's full layers gate their output (q_proj twice as wide)
        attention += hidden * heads
    mixers = [_linear_attention(config) if config.is_recurrent_layer(layer) else attention
              for layer in range(config.num_layers)]
    dense_mlp = _gated_mlp(hidden, config.intermediate_size, config.mlp_bias)
    mlps = [_moe(config, active) if config.is_moe_layer(layer) else dense_mlp for layer in range(config.num_layers)]
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return embeddings + sum(mixers) + config.num_layers * 2 * hidden + sum(mlps) + hidden


def _linear_attention(config: ModelConfig) -> int:
    """A Gated DeltaNet layer: input projections (q, k, v, z, b, a), convolution, decay and step biases,
    gated norm, output projection."""
    linear, hidden = config.linear_attention, config.hidden_size
    heads = linear.num_value_heads
    inputs = hidden * (linear.conv_dim + linear.value_dim + 2 * heads)
    return inputs + linear.conv_dim * linear.conv_kernel + 2 * heads + linear.value_head_dim + linear.value_dim * hidden


def _gated_mlp(hidden: int, intermediate: int, bias: bool) -> int:
    return 3 * hidden * intermediate + (2 * intermediate + hidden if bias else 0)


def _moe(config: ModelConfig, active: bool) -> int:
    moe, hidden = config.moe, config.hidden_size
    experts = moe.top_k if active else moe.num_experts
    router = moe.num_experts * (hidden + moe.router_bias + moe.selection_bias)
    expert = _gated_mlp(hidden, moe.intermediate_size, moe.expert_bias)
    shared = _gated_mlp(hidden, moe.shared_intermediate_size, config.mlp_bias) if moe.shared_intermediate_size else 0
    return router + experts * expert + shared + (hidden if moe.shared_expert_gate else 0)


def _quantization(path: Path) -> str:
    """How the weights are stored: a GGUF's file type ("Q4_1"), or a folder's dtype ("BF16")."""
    if path.suffix == ".gguf":
        import gguf

        reader = gguf.GGUFReader(path)
        field = reader.fields.get("general.file_type")
        if field is None:
            return ""
        return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    dtype = config.get("torch_dtype") or config.get("dtype") or ""
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, dtype.upper())
