"""Gemma 3 (`Gemma3ForCausalLM`; the text part of `Gemma3ForConditionalGeneration`; GGUF `gemma3`): the
Gemma decoder of models/layers/gemma.py.

Sliding-window layers (`sliding_window`, local rope theta, 10k) and every N-th a full-attention layer (global
theta, 1M, with the checkpoint's rope scaling: linear x8 on the 4B-27B models), from `layer_types` or
`sliding_window_pattern` (6). No attention soft-cap (`attn_logit_softcapping` is ignored, as transformers
ignores it). Norms scale by (1 + w) in Hugging Face checkpoints; llama.cpp's converter adds
the 1 into its GGUFs. Logits scaled by `query_pre_attn_scalar` ** -0.5. A multimodal checkpoint's language
model is served alone: its vision tower and projector are left unloaded (the loader says so at start).
"""

from __future__ import annotations

import re
from typing import Any

from localserve.models.config import (
    GemmaOptions,
    LayerAttention,
    ModelConfig,
    ModelConfigError,
    RopeConfig,
    hf_decoder_fields,
    rope_from_hf,
)
from localserve.models.family import DECODER_LAYER_TENSORS, Family, GGUFMetadata, Target, gguf_decoder_fields
from localserve.models.layers.gemma import GemmaForCausalLM

LAYER_TYPES = ("sliding_attention", "full_attention")


class Gemma3ForCausalLM(GemmaForCausalLM):
    """The Gemma decoder under the name its checkpoints declare (what logs and reports show)."""


ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# A multimodal checkpoint's language model (transformers 5's prefix, then earlier ones) -> the decoder's
LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                           "language_model.lm_head.": "lm_head."}
UNLOADED = re.compile(r"(model\.)?(vision_tower|multi_modal_projector|audio_tower|embed_vision|embed_audio)\.")
# A layer's GGUF tensors -> ours: the decoder's, with Gemma's four norms around attention and MLP
GEMMA_LAYER_TENSORS = DECODER_LAYER_TENSORS | {"post_attention_norm": "post_attention_layernorm",
                                               "ffn_norm": "pre_feedforward_layernorm",
                                               "post_ffw_norm": "post_feedforward_layernorm"}


# transformers' Gemma3TextConfig defaults: the multimodal checkpoints' text_config leaves some out (vocab_size)
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "rms_norm_eps": 1e-6, "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256}


def text_config(config: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal) config, over `defaults` for the fields it omits."""
    return (defaults or {}) | (config.get("text_config") or config)


def gemma_fields(config: dict[str, Any], source: str, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields Gemma 3 and Gemma 4 read alike from a Hugging Face config (a family adds the rest)."""
    text = text_config(config, defaults)
    fields = hf_decoder_fields(text, source)
    # transformers ties Gemma's head to its embeddings unless told otherwise; a multimodal config's own rules
    fields["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    fields["max_position_embeddings"] = int(text.get("max_position_embeddings", 131072))
    activation = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        raise ModelConfigError(f"{source}: unsupported hidden_activation {activation!r}; supported: "
                               f"{', '.join(ACTIVATIONS)}")
    fields |= dict(hidden_act=ACTIVATIONS[activation], embedding_scale=fields["hidden_size"] ** 0.5,
                   final_logit_softcap=text.get("final_logit_softcapping"), qk_norm=True)
    return fields


def layer_types(text: dict[str, Any], num_layers: int, source: str) -> list[str]:
    """Each layer's kind: `layer_types`, else every `sliding_window_pattern`-th layer full (6 by default)."""
    kinds = text.get("layer_types")
    if kinds is None:
        pattern = int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or 6)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if len(kinds) != num_layers or any(kind not in LAYER_TYPES for kind in kinds):
        raise ModelConfigError(f"{source}: layer_types must name {num_layers} layers, each one of "
                               f"{', '.join(LAYER_TYPES)}; got {kinds!r}")
    return list(kinds)


DEFAULT_ROPES = {"full_attention": {"rope_theta": 1_000_000.0}, "sliding_attention": {"rope_theta": 10_000.0}}


def layer_ropes(text: dict[str, Any], source: str,
                defaults: dict[str, dict[str, Any]] = DEFAULT_ROPES) -> dict[str, RopeConfig]:
    """The rotary embedding of each layer kind: transformers 5's `rope_parameters` per kind (a kind not
    there: `defaults`), else the global `rope_theta` / `rope_scaling` and the local `rope_local_base_freq`."""
    params = text.get("rope_parameters") or {}
    if any(kind in params for kind in LAYER_TYPES):
        ropes = {}
        for kind in LAYER_TYPES:
            own = params.get(kind) or defaults[kind]
            own = {"rope_theta": defaults[kind]["rope_theta"]} | own
            try:
                ropes[kind] = rope_from_hf({"rope_parameters": own}, source)
            except ModelConfigError as exc:
                raise ModelConfigError(f"{exc} (rope_parameters.{kind})") from None
        return ropes
    full = rope_from_hf(text | {"rope_theta": text.get("rope_theta", 1_000_000.0)}, source)
    return {"full_attention": full,
            "sliding_attention": RopeConfig(theta=float(text.get("rope_local_base_freq", 10_000.0)))}


def refuse_bidirectional(text: dict[str, Any], source: str) -> None:
    if text.get("use_bidirectional_attention") in (True, "all"):
        raise ModelConfigError(f"{source}: use_bidirectional_attention {text['use_bidirectional_attention']!r} "
                               "(an encoder) is not served; only causal attention is")


def hf_config(config: dict[str, Any], source: str) -> ModelConfig:
    text = text_config(config, GEMMA3_TEXT_DEFAULTS)
    fields = gemma_fields(config, source, GEMMA3_TEXT_DEFAULTS)
    refuse_bidirectional(text, source)
    window = int(text.get("sliding_window") or 4096)
    ropes = layer_ropes(text, source)
    layers = tuple(LayerAttention(fields["num_kv_heads"], fields["head_dim"],
                                  window if kind == "sliding_attention" else None, rope=ropes[kind])
                   for kind in layer_types(text, fields["num_layers"], source))
    # `attn_logit_softcapping` (Gemma 2's) is left out as transformers' Gemma 3 leaves it out (and llama.cpp's
    # converter refuses it): no Gemma 3 checkpoint sets it
    gemma = GemmaOptions(norm_offset=1.0)
    scalar = text.get("query_pre_attn_scalar", fields["head_dim"])
    unloaded = ("vision tower", "multimodal projector") if "vision_config" in config else ()
    return ModelConfig(architecture=config["architectures"][0], **fields | {"rope": ropes["full_attention"]},
                       layer_attention=layers, attention_scale=float(scalar) ** -0.5, gemma=gemma,
                       unloaded_parts=unloaded)


def hf_targets(name: str, config: ModelConfig) -> list[Target] | None:
    """A multimodal checkpoint's language-model tensors under the decoder's names; its other parts dropped."""
    if UNLOADED.match(name):
        return []
    for prefix, ours in LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return [Target(ours + name.removeprefix(prefix))]
    return None


def gguf_window_kinds(meta: GGUFMetadata, num_layers: int, default_pattern: int) -> list[str]:
    """Each layer's kind from `attention.sliding_window_pattern` (one bool per layer, or a period), else
    every `default_pattern`-th layer full (what llama.cpp assumes for Gemma 3)."""
    pattern = meta.get("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ModelConfigError(f"{meta.source}: {meta.architecture}.attention.sliding_window_pattern has "
                                   f"{len(pattern)} entries for {num_layers} layers")
        return ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    return ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(num_layers)]


def gguf_config(meta: GGUFMetadata) -> ModelConfig:
    fields = gguf_decoder_fields(meta)
    window = meta.get("attention.sliding_window")
    if not window:
        raise ModelConfigError(f"{meta.source}: a gemma3 file needs gemma3.attention.sliding_window")
    local = RopeConfig(theta=float(meta.get("rope.freq_base_swa", 10_000.0)))
    layers = tuple(LayerAttention(fields["num_kv_heads"], fields["head_dim"],
                                  int(window) if kind == "sliding_attention" else None,
                                  rope=local if kind == "sliding_attention" else fields["rope"])
                   for kind in gguf_window_kinds(meta, fields["num_layers"], 6))
    # llama.cpp's GGUFs keep no query_pre_attn_scalar: it is hidden / heads for the 27B model (62 layers),
    # the head size for the others, as llama.cpp assumes
    scalar = fields["hidden_size"] / fields["num_heads"] if fields["num_layers"] == 62 else fields["head_dim"]
    softcap = meta.get("final_logit_softcapping")
    gemma = GemmaOptions()
    return ModelConfig(architecture="Gemma3ForCausalLM", **fields | {"qk_norm": True}, layer_attention=layers,
                       attention_scale=float(scalar) ** -0.5, hidden_act="gelu_tanh",
                       embedding_scale=fields["hidden_size"] ** 0.5,
                       final_logit_softcap=None if softcap is None else float(softcap), gemma=gemma)


FAMILY = Family(name="gemma3", model_class=Gemma3ForCausalLM, hf_config=hf_config, gguf_config=gguf_config,
                hf_targets=hf_targets, layer_tensors=GEMMA_LAYER_TENSORS)
