"""Read a .gguf file: model config from its metadata, weights tensor by tensor, dequantized or kept in
their quantized blocks.

GGUF names (`blk.3.attn_q.weight`) map onto Hugging Face names (`model.layers.3.self_attn.q_proj.weight`).
llama.cpp's converter interleaves the rotary halves of Q and K for the `llama` architecture; they are
permuted back here so the one model implementation (HF rotate-half layout) serves both sources (a
permutation of whole rows, so quantized blocks are permuted as they are).
With `keep_quantized`, every linear and embedding weight of a type the kernels read (QUANT_FORMATS) stays
as its blocks (`QuantizedTensor`); everything else is dequantized as before.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from localserve.kernels.gguf_blocks import QUANT_FORMATS
from localserve.loading.pooling_config import PoolingConfigError, gguf_pooling
from localserve.models.config import ModelConfig, ModelConfigError, RopeConfig
from localserve.models.quantized import QuantizedTensor

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}


class GGUFLoadError(RuntimeError):
    """A .gguf file that cannot be loaded; the message names the file and the problem."""


def open_gguf(path: Path):  # -> gguf.GGUFReader
    """Open a GGUF file, turning the reader's low-level failures into one clear error."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except ValueError as exc:
        match = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
        if match:
            raise GGUFLoadError(f"{path}: a tensor has unknown GGML type {match.group(1)} "
                                f"(gguf {importlib.metadata.version('gguf')} does not know it)") from None
        raise GGUFLoadError(f"{path}: cannot read GGUF ({exc})") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(path: Path, reader=None) -> ModelConfig:
    """Build the ModelConfig from a GGUF's metadata (`reader`: an already open GGUFReader of `path`)."""
    reader = reader or open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelConfigError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def meta(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    num_heads = int(meta("attention.head_count"))
    hidden_size = int(meta("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    freq_factors = None
    if "rope_freqs.weight" in tensor_names:
        rope_freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        freq_factors = tuple(float(x) for x in np.asarray(rope_freqs.data, dtype=np.float32))
    scaling = meta("rope.scaling.type", "none")
    rope_type = {"none": "default", "linear": "linear", "yarn": "yarn"}.get(scaling)
    if rope_type is None:
        raise ModelConfigError(f"{path}: unsupported rope scaling {scaling!r}")
    rope = RopeConfig(theta=float(meta("rope.freq_base", 10000.0)), rope_type=rope_type,
                      factor=float(meta("rope.scaling.factor", 1.0)),
                      original_max_position_embeddings=meta("rope.scaling.original_context_length"),
                      freq_factors=freq_factors)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    head_dim = meta("attention.key_length") or hidden_size // num_heads
    try:
        pooling = gguf_pooling(meta("pooling_type"), GGUF_ARCHITECTURES[arch], str(path))
    except PoolingConfigError as exc:
        raise ModelConfigError(str(exc)) from None
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden_size,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=rope,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=Path(path).stem,
        pooling=pooling,
    )


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the model does not hold."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of rotary halves in a Q or K projection (weight or bias)."""
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def keeps_quantized(tensor) -> bool:
    """Whether a GGUF tensor (a ReaderTensor) stays in its blocks under --keep-quantized-weights: the
    weight of a linear layer or of the embeddings, in a type the kernels read."""
    name = hf_name(tensor.name)
    return (tensor.tensor_type.name in QUANT_FORMATS and len(tensor.shape) == 2 and name is not None
            and name.endswith(".weight") and "norm" not in name)


def gguf_weight_bytes(reader, bytes_per_param: float) -> tuple[int, int]:
    """(bytes, bytes) of a GGUF's model weights once loaded: with the tensors `keeps_quantized` names at
    their stored size, and with every tensor dequantized to `bytes_per_param` bytes a value."""
    stored = dense = 0
    for tensor in reader.tensors:
        if hf_name(tensor.name) is None:
            continue
        as_dense = int(tensor.n_elements * bytes_per_param)
        dense += as_dense
        stored += int(tensor.n_bytes) if keeps_quantized(tensor) else as_dense
    return stored, dense


def iter_gguf_weights(path: Path, config: ModelConfig, reader=None,
                      keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (HF name, weight) for every model tensor, one at a time: a float32 tensor, or with
    `keep_quantized` a QuantizedTensor for the tensors `keeps_quantized` names."""
    import gguf

    reader = reader or open_gguf(path)
    permute = _field(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                continue  # read into the config
            raise GGUFLoadError(f"{path}: unexpected tensor {tensor.name!r}")
        if keep_quantized and keeps_quantized(tensor):
            weight = torch.from_numpy(np.array(tensor.data))  # uint8 [rows, row_bytes], copied out of the mmap
        else:
            try:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:
                raise GGUFLoadError(f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                                    "which cannot be dequantized") from None
            weight = torch.tensor(array, dtype=torch.float32)  # a copy: F32 tensors are views of the mmap
        if permute and tensor.name.split(".")[2:3] in (["attn_q"], ["attn_k"]):
            heads = config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads
            weight = unpermute_rotary(weight, heads).contiguous()
        if weight.dtype == torch.uint8:
            columns = int(tensor.shape[0])  # GGUF lists dimensions innermost first
            yield name, QuantizedTensor(weight, tensor.tensor_type.name, (weight.shape[0], columns))
        else:
            yield name, weight
