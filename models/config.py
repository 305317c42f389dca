"""The project's own model description, built from a Hugging Face `config.json` or GGUF metadata.

Models never see transformers objects: everything they need is in `ModelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from localserve.models.pooling import PoolingSpec

# Architectures from config.json -> the features that tell them apart.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelConfigError(ValueError):
    """A model configuration this project cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    # Per-frequency divisors stored in a GGUF's `rope_freqs.weight` (llama3 scaling there).
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and features of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    # An embedding model's pooling (loading/pooling_config.py); None for a generation model.
    pooling: PoolingSpec | None = None

    @property
    def kv_bytes_per_token_fp16(self) -> int:
        """Bytes of K and V for one token over all layers in a 16-bit cache."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @property
    def context_length(self) -> int:
        """Longest sequence the model serves; a sliding window (not implemented) caps it."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "model", source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face config dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        architectures = config.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"{source}: unsupported architecture {architectures or config.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        features = SUPPORTED_ARCHITECTURES[arch]
        try:
            num_heads = int(config["num_attention_heads"])
            hidden_size = int(config["hidden_size"])
            head_dim = config.get("head_dim") or hidden_size // num_heads
            eos = config.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            use_window = config.get("use_sliding_window", arch == "MistralForCausalLM")
            return cls(
                architecture=arch,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_hf(config, source),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=features.get("qkv_bias", False) or bool(config.get("attention_bias", False)),
                o_bias=bool(config.get("attention_bias", False)) and arch != "Qwen3ForCausalLM",
                mlp_bias=bool(config.get("mlp_bias", False)),
                qk_norm=features.get("qk_norm", False),
                sliding_window=config.get("sliding_window") if use_window else None,
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
            )
        except KeyError as exc:
            raise ModelConfigError(f"{source}: missing field {exc.args[0]!r}") from None


def _rope_from_hf(config: dict[str, Any], source: str) -> RopeConfig:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(f"{source}: unsupported rope type {rope_type!r}; supported: "
                               f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    original = params.get("original_max_position_embeddings")
    if rope_type == "yarn" and original is None:
        original = config.get("max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
    )
