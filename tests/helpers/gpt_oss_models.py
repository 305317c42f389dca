"""Tiny random gpt-oss models made with transformers' own `GptOssConfig`, whose windows, sinks and clamps
all matter: windows of 16 tokens (prompts cross several), sinks of both signs (transformers' own init
draws them near zero), expert gate/up weights wide enough that the clamped SwiGLU's limit cuts some
values; saved by save_pretrained (experts as transformers stores them: [E, H, 2I], gate and up rows
interleaved), or rewritten with the experts as the released checkpoints hold them (MXFP4 `_blocks` and
`_scales`)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.gguf_convert import write_bpe_tokenizer

SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>"]
VOCAB = 320
WINDOW = 16
EXPERT_GATE_UP_SCALE = 2.5  # on top of save_random_model's spread: gate/up pre-activations past the limit 7


def tiny_config(**changes):
    import transformers

    return transformers.GptOssConfig(**(dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 256, "rope_theta": 150000.0})
        | changes))


def save_gpt_oss(folder: Path, config, seed: int = 0, dtype: torch.dtype = torch.float32, sink_scale: float = 1.0,
                 sink_offset: float = 0.0, tokenizer: bool = True):
    """A random model of `config` saved into `folder` (with a small BPE tokenizer unless not `tokenizer`);
    returns the transformers model. The sinks: normal, times `sink_scale`, plus `sink_offset`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.2 if param.dim() > 1 else 1.0)
            if param.dim() == 1 and not name.endswith("sinks"):
                param.abs_().add_(0.5)
            if name.endswith("sinks"):
                param.mul_(sink_scale).add_(sink_offset)
            if name.endswith("gate_up_proj"):
                param.mul_(EXPERT_GATE_UP_SCALE)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    if tokenizer:
        write_bpe_tokenizer(folder, VOCAB, SPECIALS)
    return model


def hf_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [E, out, in] -> the released checkpoints' (blocks [E, out, in / 32, 16], scales [E, out, in / 32]):
    quantized by gguf-py, its nibbles laid out as transformers reads them (value 2i low, 2i + 1 high)."""
    packed = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    packed = torch.from_numpy(np.ascontiguousarray(packed)).reshape(*weight.shape[:2], -1, 17)
    scales, codes_by_half = packed[..., 0], packed[..., 1:]
    codes = torch.cat((codes_by_half & 0x0F, codes_by_half >> 4), dim=-1)  # [..., 32] in value order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales.contiguous()


def write_mxfp4_folder(dense: Path, folder: Path) -> Path:
    """`dense`'s model with its experts as MXFP4 pairs and `quantization_config` saying so."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in load_file(dense / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = hf_mxfp4(tensor.transpose(1, 2))
        else:
            tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (folder / name).write_bytes((dense / name).read_bytes())
    return folder


def mxfp4_reference(folder: Path):
    """transformers' own reading of an MXFP4 folder, its experts dequantized (float32)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
