"""Qwen3-Next (`Qwen3NextForCausalLM`, model type `qwen3_next`): the hybrid decoder of Qwen3.5
(models/qwen3_5.py, models/layers/hybrid.py) with Qwen3-Next's checkpoint layout and MLPs.

- The linear layers' input projections are fused per key head, `linear_attn.in_proj_qkvz` (q, k, v, z)
  and `linear_attn.in_proj_ba` (b, a): kept fused in the model as stored (LinearAttentionConfig
  `fused_qkvz`, `fused_ba`; models/layers/gated_deltanet.py splits their outputs).
- MLPs: a mixture of experts (softmax top k, renormalised where `norm_topk_prob`, a shared expert scaled by
  sigmoid(`mlp.shared_expert_gate` . x)) on the layers off `mlp_only_layers` and on the
  `decoder_sparse_step`; a dense MLP (`intermediate_size`) on the others, or everywhere without experts.
"""

from __future__ import annotations

from typing import Any

from localserve.models.config import ModelConfig
from localserve.models.family import Family
from localserve.models.layers.hybrid import HybridForCausalLM
from localserve.models.qwen3_5 import hf_targets, hybrid_config
from localserve.models.qwen3_5_gguf import gguf_config, gguf_layer_targets
from localserve.models.qwen3_5_moe import shared_expert_moe


class Qwen3NextForCausalLM(HybridForCausalLM):
    """The hybrid decoder under the name its checkpoints declare (what logs and reports show)."""


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    moe = None
    if int(config.get("num_experts") or 0) > 0:
        num_layers = int(config.get("num_hidden_layers", 0))
        step = int(config.get("decoder_sparse_step", 1))
        dense_only = set(config.get("mlp_only_layers") or ())
        dense = tuple(layer for layer in range(num_layers)
                      if layer in dense_only or step <= 0 or (layer + 1) % step)
        moe = shared_expert_moe(config, source, bool(config.get("norm_topk_prob", True)), dense)
    return hybrid_config(config, source, "Qwen3NextForCausalLM", moe=moe, fused=True)


FAMILY = Family(name="qwen3_next", model_class=Qwen3NextForCausalLM, hf_config=hf_config, hf_targets=hf_targets,
                gguf_config=gguf_config, gguf_layer_targets=gguf_layer_targets)
