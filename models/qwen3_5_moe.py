"""Qwen3.5 / Qwen3.6 mixture-of-experts models (`Qwen3_5MoeForConditionalGeneration`, `Qwen3_5MoeForCausalLM`;
model types `qwen3_5_moe`, `qwen3_5_moe_text`): Qwen3.5's hybrid decoder (models/qwen3_5.py) with a mixture
of experts in every layer: softmax over `num_experts`, the top `num_experts_per_tok` renormalised, experts
of `moe_intermediate_size`, beside a shared expert of `shared_expert_intermediate_size` scaled by
sigmoid(`mlp.shared_expert_gate` . x). Experts stacked (`mlp.experts.gate_up_proj`) or one tensor each, as
Qwen3-MoE's checkpoints (models/qwen3_moe.py).
"""

from __future__ import annotations

from typing import Any

from localserve.models.config import ModelConfig, ModelConfigError, MoEConfig
from localserve.models.family import Family
from localserve.models.layers.hybrid import HybridForCausalLM
from localserve.models.qwen3_5 import hf_targets, hybrid_config
from localserve.models.qwen3_5_gguf import gguf_config, gguf_layer_targets


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    """The hybrid decoder under the name its checkpoints declare (what logs and reports show)."""


def shared_expert_moe(text: dict[str, Any], source: str, normalize: bool, dense: tuple[int, ...] = ()) -> MoEConfig:
    """The experts of Qwen3.5-MoE and Qwen3-Next: softmax top k, a gated shared expert."""
    try:
        return MoEConfig(num_experts=int(text["num_experts"]), top_k=int(text["num_experts_per_tok"]),
                         intermediate_size=int(text["moe_intermediate_size"]), router="softmax_topk",
                         normalize=normalize, dense_layers=dense,
                         shared_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
                         shared_expert_gate=True)
    except KeyError as exc:
        raise ModelConfigError(f"{source}: missing field {exc.args[0]!r}") from None
    except ModelConfigError as exc:
        raise ModelConfigError(f"{source}: {exc}") from None


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    text = config.get("text_config") or config
    return hybrid_config(config, source, config["architectures"][0], moe=shared_expert_moe(text, source, True))


FAMILY = Family(name="qwen3_5_moe", model_class=Qwen3_5MoeForCausalLM, hf_config=hf_config, hf_targets=hf_targets,
                gguf_config=gguf_config, gguf_layer_targets=gguf_layer_targets)
