"""GGUF files of the hybrid linear-attention families: llama.cpp's `qwen35` (Qwen3.5 / Qwen3.6 dense),
`qwen35moe` (their mixtures of experts) and `qwen3next` (Qwen3-Next), as its convert_hf_to_gguf.py writes them.

The metadata: the full-attention layers as any decoder's (`attention.*`, `rope.freq_base`), the rotary part
of each head in `rope.dimension_count`, the Gated DeltaNet mixer in `ssm.*` (`group_count`: key heads,
`time_step_rank`: value heads, `state_size`: the key head size, `inner_size`: all value heads' width,
`conv_kernel`), which layers are linear in `attention.recurrent_layers` (else every `full_attention_interval`-th
layer attends), the multi-token-prediction blocks appended after the decoder's in `nextn_predict_layers`
(not loaded), the experts in `expert_*`.

How the model reads what the converter changed (LinearAttentionConfig's layout switches), so that every
tensor loads as stored (and a quantized one stays in its blocks):
- Every RMSNorm but the mixer's gated one is stored as 1 + w (the checkpoints' zero-centred w):
  `norm_offset` 0, the model scales by the stored value itself.
- `A_log` is stored as -exp(A_log) (`ssm_a`, no `.weight`): the model's parameter `A` holds it
  (`log_decay_rate` False).
- The convolution [C, 1, K] is stored as [C, K] (the loader reshapes).
- Qwen3-Next's fused `in_proj_qkvz` (per key head q, k, v, z) is stored as `attn_qkv` (all q, all k, all v)
  and `attn_gate` (all z), the layout of Qwen3.5's `in_proj_qkv` and `in_proj_z` (`fused_qkvz` False); its
  `in_proj_ba` (per key head b, a) as is (`ssm_ba`, `fused_ba`).
- Qwen3.5's value heads are stored tiled (value head j served by key head j % key heads, where the
  checkpoints group them by key head): `tiled_value_heads`.
"""

from __future__ import annotations

from dataclasses import replace

from localserve.models.config import LayerAttention, LinearAttentionConfig, ModelConfig, ModelConfigError, MoEConfig
from localserve.models.family import GGUFMetadata, Target, gguf_decoder_fields
from localserve.models.layers.attention import check_layers

ARCHITECTURES = {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
                 "qwen3next": "Qwen3NextForCausalLM"}
SSM_KEYS = ("ssm.group_count", "ssm.time_step_rank", "ssm.state_size", "ssm.inner_size", "ssm.conv_kernel")


def _required(meta: GGUFMetadata, key: str) -> int:
    value = meta.get(key)
    if value is None:
        raise ModelConfigError(f"{meta.source}: a {meta.architecture} file needs {meta.architecture}.{key}")
    return int(value)


def linear_attention_config(meta: GGUFMetadata) -> LinearAttentionConfig:
    """The Gated DeltaNet mixer from `ssm.*`, in the layout the file stores (module doc)."""
    key_heads, value_heads, key_dim, inner, kernel = (_required(meta, key) for key in SSM_KEYS)
    if inner % value_heads:
        raise ModelConfigError(f"{meta.source}: {meta.architecture}.ssm.inner_size {inner} is not a multiple of "
                               f"ssm.time_step_rank {value_heads} (the value heads)")
    try:
        return LinearAttentionConfig(num_key_heads=key_heads, num_value_heads=value_heads, key_head_dim=key_dim,
                                     value_head_dim=inner // value_heads, conv_kernel=kernel,
                                     fused_ba=meta.architecture == "qwen3next",
                                     tiled_value_heads=meta.architecture != "qwen3next", log_decay_rate=False,
                                     norm_offset=0.0)
    except ModelConfigError as exc:
        raise ModelConfigError(f"{meta.source}: {exc}") from None


def recurrent_layers(meta: GGUFMetadata, num_layers: int) -> list[bool]:
    """Which of the decoder's layers are linear: `attention.recurrent_layers` (one bool a block, the MTP
    blocks after the decoder's included), else all but every `full_attention_interval`-th; at least one
    must attend (as for a Hugging Face config, models/qwen3_5.py)."""
    flags = meta.get("attention.recurrent_layers")
    if flags is not None:
        flags = [bool(flag) for flag in flags]
        if len(flags) < num_layers:
            raise ModelConfigError(f"{meta.source}: {meta.architecture}.attention.recurrent_layers has "
                                   f"{len(flags)} entries for {num_layers} layers")
        flags = flags[:num_layers]
    else:
        interval = int(meta.get("full_attention_interval", 4))
        if interval < 1:
            raise ModelConfigError(f"{meta.source}: {meta.architecture}.full_attention_interval must be >= 1, "
                                   f"got {interval}")
        flags = [(layer + 1) % interval != 0 for layer in range(num_layers)]
    if all(flags):
        raise ModelConfigError(f"{meta.source}: no full-attention layer among the {num_layers} layers; this project "
                               "serves hybrid models with at least one")
    return flags


def moe_config(meta: GGUFMetadata, num_layers: int) -> MoEConfig | None:
    """The experts (None for a dense file): softmax top-k renormalised, a shared expert with its sigmoid
    gate; layers without a router are dense."""
    if meta.get("expert_count") is None:
        return None
    names = meta.tensor_names
    dense = tuple(layer for layer in range(num_layers) if f"blk.{layer}.ffn_gate_inp.weight" not in names)
    shared_gate = any(name.endswith(".ffn_gate_inp_shexp.weight") for name in names)
    try:
        return MoEConfig(num_experts=_required(meta, "expert_count"), top_k=_required(meta, "expert_used_count"),
                         intermediate_size=_required(meta, "expert_feed_forward_length"), router="softmax_topk",
                         normalize=bool(meta.get("expert_weights_norm", True)),
                         shared_intermediate_size=int(meta.get("expert_shared_feed_forward_length", 0)),
                         shared_expert_gate=shared_gate, dense_layers=dense)
    except ModelConfigError as exc:
        raise ModelConfigError(f"{meta.source}: {exc}") from None


def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    """A `qwen35`, `qwen35moe` or `qwen3next` file's config."""
    architecture = ARCHITECTURES.get(meta.architecture)
    if architecture is None:
        raise ModelConfigError(f"{meta.source}: {meta.architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    fields = gguf_decoder_fields(meta)
    num_layers = fields["num_layers"] - int(meta.get("nextn_predict_layers", 0))
    if num_layers < 1:
        raise ModelConfigError(f"{meta.source}: {meta.architecture}.block_count {fields['num_layers']} leaves "
                               "no decoder layer beside the nextn_predict_layers")
    linear = linear_attention_config(meta)
    rotary_dim = int(meta.get("rope.dimension_count", fields["head_dim"]))
    layers = tuple(LayerAttention(fields["num_kv_heads"], fields["head_dim"], rotary_dim=rotary_dim,
                                  state=linear.state if recurrent else None)
                   for recurrent in recurrent_layers(meta, num_layers))
    moe = moe_config(meta, num_layers)
    unloaded = ("multi-token prediction layers",) if num_layers < fields["num_layers"] else ()
    if meta.architecture != "qwen3next":  # Qwen3.5's multimodal rotary sections (llama.cpp: 4, the last 0)
        sections = meta.get("rope.dimension_sections", [11, 11, 10, 0])
        fields["rope"] = replace(fields["rope"], mrope_section=tuple(int(n) for n in list(sections)[:3]))
    read = ModelConfig(architecture=architecture, **fields | {"num_layers": num_layers, "qk_norm": True},
                       rotary_dim=rotary_dim, layer_attention=layers, linear_attention=linear, moe=moe,
                       unloaded_parts=unloaded)
    check_layers(read, meta.source)
    return read


def gguf_layer_targets(kind: str, suffix: str, prefix: str, config: ModelConfig) -> list[Target] | None:
    """Where a layer's tensor goes (module doc): the mixer's, the norm after attention, nothing for the
    multi-token-prediction blocks; None for the decoder's tensors every family shares."""
    layer = int(prefix.split(".")[2])
    if layer >= config.num_layers:
        return []  # a multi-token-prediction block (`nextn_predict_layers`), not loaded
    if kind == "post_attention_norm":
        return [Target(f"{prefix}post_attention_layernorm.{suffix}")]
    if config.linear_attention is None or config.layer_attention[layer].state is None:
        return None
    mixer = f"{prefix}linear_attn."
    if kind in MIXER_PARAMETERS:
        return [Target(mixer + MIXER_PARAMETERS[kind])]
    return [Target(f"{mixer}{MIXER_TENSORS[kind]}.{suffix}")] if kind in MIXER_TENSORS else None


# A linear layer's GGUF tensors -> our modules after `model.layers.N.linear_attn.` (`.weight` beside)
MIXER_TENSORS = {"attn_qkv": "in_proj_qkv", "attn_gate": "in_proj_z", "ssm_ba": "in_proj_ba", "ssm_beta": "in_proj_b",
                 "ssm_alpha": "in_proj_a", "ssm_conv1d": "conv1d", "ssm_norm": "norm", "ssm_out": "out_proj"}
# ... and those that are a parameter of the mixer itself: `ssm_dt.bias`, `ssm_a` (no suffix)
MIXER_PARAMETERS = {"ssm_dt": "dt_bias", "ssm_a": "A"}
