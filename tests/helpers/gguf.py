"""Write small GGUF files the way llama.cpp's converter lays them out (Q/K rotary halves interleaved)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (rotate-half -> interleaved)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[module]}.{kind}"


def write_llama_gguf(path: Path, hf_model,
                     quant_types: dict[str, gguf.GGMLQuantizationType]) -> dict[str, torch.Tensor]:
    """Write `hf_model` (a transformers Llama) to `path`; 2-D tensors whose GGUF name contains a key of
    `quant_types` are quantized with that type. Returns the HF state dict as the GGUF holds it
    (quantized then dequantized), i.e. the weights of its safetensors twin."""
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    twin: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        target = gguf_name(name)
        stored = array
        if ".attn_q." in target:
            stored = llama_cpp_permute(array, config.num_attention_heads)
        elif ".attn_k." in target:
            stored = llama_cpp_permute(array, config.num_key_value_heads)
        qtype = next((t for key, t in quant_types.items() if key in target), None)
        if qtype is not None and array.ndim == 2:
            packed = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(target, packed, raw_dtype=qtype)
            array = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
        else:
            writer.add_tensor(target, stored)
        twin[name] = torch.from_numpy(np.array(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return twin
