"""Qwen3-MoE: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B (`Qwen3MoeForCausalLM`; GGUF `qwen3moe`).

Qwen3's attention (q/k norm) with a mixture-of-experts MLP: softmax over the experts, the top k, their
weights renormalised when `norm_topk_prob` (llama.cpp's GGUFs always renormalise); no shared expert; the
layers in `mlp_only_layers`, or off the `decoder_sparse_step`, keep a dense MLP.

Checkpoints store the experts in one of two ways, both read here: transformers 5 stacks them
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]); earlier
checkpoints hold one tensor per expert (`mlp.experts.7.gate_proj.weight`).
"""

from __future__ import annotations

import re
from typing import Any

from localserve.models.config import ModelConfig, ModelConfigError, MoEConfig
from localserve.models.family import Family, GGUFMetadata, Target, gguf_decoder_fields, split_rows
from localserve.models.layers.decoder import DecoderForCausalLM
from localserve.models.qwen3 import qwen3_fields

PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """The shared decoder under the name its checkpoints declare (what logs and reports show); the family's
    differences are in its config reading and tensor names, not in code."""


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    fields = qwen3_fields(config, source)
    try:
        num_experts = int(config.get("num_local_experts") or config["num_experts"])
        sparse_step = int(config.get("decoder_sparse_step", 1))
        dense_only = set(config.get("mlp_only_layers") or ())
        dense = tuple(layer for layer in range(fields["num_layers"])
                      if layer in dense_only or sparse_step <= 0 or (layer + 1) % sparse_step)
        moe = MoEConfig(num_experts=num_experts, top_k=int(config["num_experts_per_tok"]),
                        intermediate_size=int(config["moe_intermediate_size"]), router="softmax_topk",
                        normalize=bool(config.get("norm_topk_prob", False)), dense_layers=dense)
    except KeyError as exc:
        raise ModelConfigError(f"{source}: missing field {exc.args[0]!r}") from None
    except ModelConfigError as exc:
        raise ModelConfigError(f"{source}: {exc}") from None
    return ModelConfig(architecture="Qwen3MoeForCausalLM", **fields, moe=moe)


def hf_targets(name: str, config: ModelConfig) -> list[Target] | None:
    if name.endswith(".mlp.experts.gate_up_proj"):
        stem = name.removesuffix("gate_up_proj")
        size = config.moe.intermediate_size
        return split_rows([stem + "gate_proj", stem + "up_proj"], [size, size], axis=1)
    match = PER_EXPERT.fullmatch(name)
    if match:
        stack, expert, projection = match.groups()
        return [Target(f"{stack}.{projection}_proj", expert=int(expert))]
    return None


def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    fields = gguf_decoder_fields(meta)
    names = meta.tensor_names
    dense = tuple(layer for layer in range(fields["num_layers"])
                  if f"blk.{layer}.ffn_gate_inp.weight" not in names)
    try:
        moe = MoEConfig(num_experts=int(meta.get("expert_count")), top_k=int(meta.get("expert_used_count")),
                        intermediate_size=int(meta.get("expert_feed_forward_length")), router="softmax_topk",
                        normalize=bool(meta.get("expert_weights_norm", True)), dense_layers=dense)
    except TypeError:
        raise ModelConfigError(f"{meta.source}: a {meta.architecture} file needs {meta.architecture}.expert_count, "
                               "expert_used_count and expert_feed_forward_length") from None
    except ModelConfigError as exc:
        raise ModelConfigError(f"{meta.source}: {exc}") from None
    return ModelConfig(architecture="Qwen3MoeForCausalLM", **fields, moe=moe)


FAMILY = Family(name="qwen3_moe", model_class=Qwen3MoeForCausalLM, hf_config=hf_config, gguf_config=gguf_config,
                hf_targets=hf_targets)
