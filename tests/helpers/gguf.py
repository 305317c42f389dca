"""Write small GGUF files the way llama.cpp's converter lays them out (Q/K rotary halves interleaved), and
model files with names and no weights worth loading (for naming a folder of models)."""

from __future__ import annotations

import json
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


def random_blocks(qtype_name: str, rows: int, cols: int, seed: int = 0, magnitude: float = 0.1) -> np.ndarray:
    """Random valid blocks uint8 [rows, row_bytes] of GGML type `qtype_name`: random code and scale bytes,
    every fp16 field (d, dmin, m) and E8M0 exponent of a size that puts the weights near +-`magnitude`."""
    from localserve.kernels.gguf_blocks import QUANT_FORMATS

    fmt = QUANT_FORMATS[qtype_name]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // fmt.block_values, fmt.block_bytes), dtype=np.uint8)
    # d times the typical size of what it multiplies (6-bit or int8 sub-scales times codes) ~ magnitude.
    typical = {"Q8_0": 64, "Q6_K": 64 * 32, "Q4_K": 32 * 8, "Q5_K": 32 * 16, "Q2_K": 8 * 2, "Q3_K": 16 * 4}
    for which, offset in enumerate(fmt.half_offsets):
        size = magnitude / typical.get(qtype_name, 8 if qtype_name.startswith("Q4") else 16)
        if which == 1 and not qtype_name.endswith("_K"):  # m of Q4_1 / Q5_1: the block's offset, signed
            field = rng.normal(0, magnitude, data.shape[:2])
        else:
            field = rng.uniform(0.5, 1.5, data.shape[:2]) * size * (rng.choice([-1, 1], data.shape[:2])
                                                                    if which == 0 and "_K" not in qtype_name else 1)
        data[:, :, offset:offset + 2] = field.astype(np.float16)[..., None].view(np.uint8)
    for offset in fmt.exponent_offsets:  # MXFP4: 2^(e - 128) times doubled E2M1 codes (mostly 1..12)
        data[:, :, offset] = rng.integers(121, 125, data.shape[:2])
    return data.reshape(rows, -1)


def write_random_gguf(path: Path, arch: str, weight_types: dict[str, str], tied: bool, seed: int = 0,
                      hidden_size: int = 256, intermediate_size: int = 512, num_layers: int = 2,
                      vocab_size: int = 256) -> None:
    """A random Llama-family GGUF (arch "llama" or "qwen2", with q/k/v biases) of 4 heads of 64 over 2 KV
    heads, whose 2-D weights are random valid blocks: `weight_types` maps a GGUF tensor name without
    ".weight" (e.g. "blk.1.ffn_down", "token_embd", "output") to a GGML type name; unnamed ones are F32."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    kv_size = 2 * 64
    shapes = {"token_embd": (vocab_size, hidden_size)} | ({} if tied else {"output": (vocab_size, hidden_size)})
    for layer in range(num_layers):
        prefix = f"blk.{layer}"
        shapes |= {f"{prefix}.attn_q": (hidden_size, hidden_size), f"{prefix}.attn_k": (kv_size, hidden_size),
                   f"{prefix}.attn_v": (kv_size, hidden_size), f"{prefix}.attn_output": (hidden_size, hidden_size),
                   f"{prefix}.ffn_gate": (intermediate_size, hidden_size),
                   f"{prefix}.ffn_up": (intermediate_size, hidden_size),
                   f"{prefix}.ffn_down": (hidden_size, intermediate_size)}
    for index, (name, (rows, cols)) in enumerate(shapes.items()):
        qtype = weight_types.get(name, "F32")
        if qtype in ("F32", "F16"):
            dense = rng.normal(0, 0.1, (rows, cols)).astype(np.float32 if qtype == "F32" else np.float16)
            writer.add_tensor(f"{name}.weight", dense)
        else:
            writer.add_tensor(f"{name}.weight", random_blocks(qtype, rows, cols, seed=seed * 1000 + index),
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
    for layer in range(num_layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.8, 1.2, hidden_size).astype(np.float32))
        if arch == "qwen2":
            for name, size in (("attn_q", hidden_size), ("attn_k", kv_size), ("attn_v", kv_size)):
                writer.add_tensor(f"blk.{layer}.{name}.bias", rng.normal(0, 0.5, size).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.8, 1.2, hidden_size).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf_header(path: Path, name: str | None = None, basename: str | None = None, **extra) -> Path:
    """A GGUF file with metadata and no tensors (naming reads nothing else)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if name is not None:
        writer.add_name(name)
    if basename is not None:
        writer.add_basename(basename)
    writer.add_context_length(2048)
    writer.add_token_list(["<s>", "a", "b"])  # an array of strings before the keys asked for below
    for key, value in extra.items():
        writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def write_hf_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"\0" * 100)
    return path
