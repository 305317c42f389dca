"""Benchmarks of the GPU path (issue #12), on a CUDA device: writes Markdown tables for docs/BENCHMARKS.md.

1. The device's copy bandwidth (a large device-to-device copy, bytes read plus written per second).
2. Decode attention per KV format (fp16, bf16, q8_0, q4_rot, K q8_0 / V q4_rot) at 1K / 8K / 32K context
   and batch 1 / 16 / 64, in Llama-3.1-8B's shapes (32 query heads, 8 KV heads, head dim 128) and
   SmolLM2's (9 / 3 / 64): median time of one layer's attention, the bytes of cache it must read, GB/s
   and the fraction of the copy bandwidth; the plain-torch backend beside it.
3. GGUF weight kernels (issue #18) at Llama-3.1-8B's linear shapes: per type, the gemv of one token
   (bytes of blocks read per second, as a fraction of the copy bandwidth) beside torch's bf16 product;
   then gemv, fused and scratch against bf16 torch.mm from 1 to 256 rows, to place the thresholds.
4. Whole-model decode tokens/s of a Llama-3.1-8B-shaped model with random bf16 weights (no download) at
   batch 1 / 16 / 64, against the roofline of reading its weights (and KV cache) once per step; then the
   same model with random Q4_K_M-mixed GGUF blocks kept quantized, and its speed-up over bf16.

Usage: python scripts/bench_kernels.py [--quick] [--sections attention,gguf,model] [--out results.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton.testing
from benchlib import row_emitter
from localserve.models.config import ModelConfig, RopeConfig
from localserve.models.layers.rotary import RotaryEmbedding

from localserve.attention.base import AttentionInputs
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.attention.triton_backend import TritonAttentionBackend
from localserve.kv.cache import PagedKVCache
from localserve.kv.calibration import LayerCalibration
from localserve.kv.formats import KVFormatSpec

GGUF_SHAPES = {"q, o": (4096, 4096), "k, v": (1024, 4096), "gate, up": (14336, 4096), "down": (4096, 14336)}
SECTIONS = ("attention", "gguf", "model")
FORMAT_PAIRS = [("fp16", "fp16"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q4_rot", "q4_rot"), ("q8_0", "q4_rot")]
SHAPES = {"Llama-3.1-8B": (32, 8, 128), "SmolLM2-135M": (9, 3, 64)}  # query heads, KV heads, head dim
CONTEXTS = [1024, 8192, 32768]
BATCHES = [1, 16, 64]
BLOCK_SIZE = 16


def copy_bandwidth(device: torch.device, num_bytes: int = 2 << 30) -> float:
    """Bytes read plus written per second by a device-to-device copy of `num_bytes`."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    milliseconds = triton.testing.do_bench(lambda: target.copy_(source), return_mode="median")
    return 2 * num_bytes / (milliseconds / 1e3)


@dataclass
class SyntheticCalibration:
    """Random means and a well-conditioned key transform, so 4-bit runs its mean and transform paths."""

    layer_calibration: LayerCalibration

    @classmethod
    def make(cls, num_kv_heads: int, head_dim: int) -> SyntheticCalibration:
        generator = torch.Generator().manual_seed(0)
        mean = torch.randn(num_kv_heads, head_dim, generator=generator)
        transform = torch.eye(head_dim) + 0.1 * torch.randn(num_kv_heads, head_dim, head_dim,
                                                            generator=generator) / math.sqrt(head_dim)
        return cls(LayerCalibration(mean, mean.flip(-1), transform))

    def layer(self, index: int) -> LayerCalibration:
        return self.layer_calibration


def random_pool(k_type: str, v_type: str, shape: tuple[int, int, int], num_blocks: int,
                device: torch.device) -> PagedKVCache:
    """A one-layer bf16-model pool filled with random stored bytes (timing does not depend on values)."""
    _, num_kv_heads, head_dim = shape
    rotary = RotaryEmbedding(RopeConfig(theta=500000.0), head_dim, device=device)
    cache = PagedKVCache(1, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, torch.bfloat16, device=device,
                         key_format=KVFormatSpec.parse(k_type), value_format=KVFormatSpec.parse(v_type),
                         calibration=SyntheticCalibration.make(num_kv_heads, head_dim),
                         rope=lambda positions: rotary(positions, torch.float32))
    for store in (cache.key_stores[0], cache.value_stores[0]):
        for name, tensor in store.items():
            if tensor.dtype.is_floating_point:
                tensor.normal_(0, 0.05 if name == "scales" else 1.0)  # signed scales: 4-bit means half used
            elif tensor.dtype == torch.int8:
                tensor.random_(-127, 128)
            else:
                tensor.random_(0, 256)
    return cache


def decode_attention_rows(device: torch.device, bandwidth: float, quick: bool, emit) -> None:
    contexts, batches = ([1024, 8192], [1, 16]) if quick else (CONTEXTS, BATCHES)
    for shape_name, shape in SHAPES.items():
        num_heads, num_kv_heads, head_dim = shape
        for k_type, v_type in FORMAT_PAIRS:
            num_blocks = max(batches) * max(contexts) // BLOCK_SIZE + 1
            cache = random_pool(k_type, v_type, shape, num_blocks, device)
            for context in contexts:
                for batch in batches:
                    emit([time_decode(cache, shape_name, shape, k_type, v_type, context, batch, bandwidth)])
            del cache
            torch.cuda.empty_cache()


def time_decode(cache: PagedKVCache, shape_name: str, shape: tuple[int, int, int], k_type: str, v_type: str,
                context: int, batch: int, bandwidth: float) -> str:
    num_heads, num_kv_heads, head_dim = shape
    device = cache.key_stores[0][next(iter(cache.key_stores[0]))].device
    blocks_per_seq = context // BLOCK_SIZE
    order = torch.randperm(batch * blocks_per_seq, device=device)
    tables = order.view(batch, blocks_per_seq)
    last_slots = tables[:, -1] * BLOCK_SIZE + BLOCK_SIZE - 1
    inputs = AttentionInputs(last_slots, torch.full((batch,), context - 1, device=device), tables, [1] * batch,
                             [context] * batch, BLOCK_SIZE)
    generator = torch.Generator(device=device).manual_seed(1)
    query = torch.randn(batch, num_heads, head_dim, device=device, dtype=torch.bfloat16, generator=generator)
    new_kv = torch.randn(batch, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16, generator=generator)
    triton_backend = TritonAttentionBackend()
    metadata = triton_backend.build_metadata(inputs)  # its plan is made by the first call, then reused
    triton_ms = triton.testing.do_bench(lambda: triton_backend.attend(0, query, cache, metadata),
                                        return_mode="median")
    torch_backend = TorchAttentionBackend()
    torch_metadata = torch_backend.build_metadata(inputs)
    torch_ms = triton.testing.do_bench(lambda: torch_backend.forward(0, query, new_kv, new_kv, cache, torch_metadata),
                                       return_mode="median")
    bytes_read = batch * context * cache.bytes_per_token()
    achieved = bytes_read / (triton_ms / 1e3)
    splits = next(iter(metadata.plans.values())).num_splits  # the one kind of layer here
    return (f"| {shape_name} | {k_type} / {v_type} | {context // 1024}K | {batch} | {triton_ms * 1e3:.1f} | "
            f"{bytes_read / 1e6:.1f} | {achieved / 1e9:.0f} | {achieved / bandwidth:.0%} | {splits} | "
            f"{torch_ms * 1e3:.1f} | {torch_ms / triton_ms:.1f}x |")


def llama31_8b_config(num_layers: int) -> ModelConfig:
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
    return ModelConfig("LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=num_layers, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope=rope, max_position_embeddings=131072, name="llama-3.1-8b-random")


def random_gguf_blocks(qtype: str, rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    """Random valid blocks uint8 [rows, row_bytes] on the generator's device: random codes and sub-scales,
    small positive fp16 fields and E8M0 exponents (the timing does not depend on the values, as long as
    they are finite)."""
    from localserve.kernels.gguf_blocks import QUANT_FORMATS

    fmt = QUANT_FORMATS[qtype]
    num_blocks = columns // fmt.block_values
    data = torch.randint(0, 256, (rows, num_blocks, fmt.block_bytes), dtype=torch.uint8, device=generator.device,
                         generator=generator)
    for offset in fmt.half_offsets:
        field = torch.empty(rows, num_blocks, dtype=torch.float16, device=generator.device)
        field.uniform_(1e-3, 2e-3, generator=generator)
        data[:, :, offset:offset + 2] = field.view(torch.uint8).view(rows, num_blocks, 2)
    for offset in fmt.exponent_offsets:  # MXFP4's E8M0 scales: 2^-9 .. 2^-7
        data[:, :, offset] = torch.randint(119, 122, (rows, num_blocks), dtype=torch.uint8, device=generator.device,
                                           generator=generator)
    return data.reshape(rows, -1)


def gguf_rows(device: torch.device, bandwidth: float, quick: bool, emit) -> None:
    """Per type, the gemv of one bf16 token at each of Llama-3.1-8B's linear shapes; then the three methods
    against bf16 torch.mm as the batch grows."""
    from localserve.kernels.gguf_blocks import QUANT_FORMATS
    from localserve.kernels.gguf_matmul import quantized_matmul

    generator = torch.Generator(device=device).manual_seed(0)
    types = ["Q4_K", "Q6_K", "Q8_0"] if quick else list(QUANT_FORMATS)
    emit(["", "GGUF gemv, one bf16 token, Llama-3.1-8B shapes (out x in):", "",
          "| type | shape | us | MB read | GB/s | of copy bw | bf16 torch us | speed-up over bf16 |",
          "|---|---|---|---|---|---|---|---|"])
    for shape_name, (rows, columns) in GGUF_SHAPES.items():
        x = torch.randn(1, columns, device=device, dtype=torch.bfloat16, generator=generator)
        dense = torch.randn(rows, columns, device=device, dtype=torch.bfloat16, generator=generator)
        dense_ms = triton.testing.do_bench(lambda: x @ dense.T, return_mode="median")  # noqa: B023
        del dense
        for qtype in types:
            blocks = random_gguf_blocks(qtype, rows, columns, generator)
            fmt = QUANT_FORMATS[qtype]
            ms = triton.testing.do_bench(lambda: quantized_matmul(x, blocks, fmt, columns, method="gemv"),  # noqa: B023
                                         return_mode="median")
            achieved = (blocks.numel() + 2 * (columns + rows)) / (ms / 1e3)
            emit([f"| {qtype} | {shape_name} {rows} x {columns} | {ms * 1e3:.1f} | {blocks.numel() / 1e6:.1f} | "
                  f"{achieved / 1e9:.0f} | {achieved / bandwidth:.0%} | {dense_ms * 1e3:.1f} | {dense_ms / ms:.2f}x |"])
    rows, columns = GGUF_SHAPES["gate, up"]
    emit(["", f"GGUF methods by batch, Q4_K {rows} x {columns}, bf16 (us):", "",
          "| batch | gemv | fused | scratch | bf16 torch.mm |", "|---|---|---|---|---|"])
    blocks = random_gguf_blocks("Q4_K", rows, columns, generator)
    dense = torch.randn(rows, columns, device=device, dtype=torch.bfloat16, generator=generator)
    for batch in ([1, 4, 16, 128] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]):
        x = torch.randn(batch, columns, device=device, dtype=torch.bfloat16, generator=generator)
        cells = []
        for method in ("gemv", "fused", "scratch"):
            if method == "gemv" and batch > 4:
                cells.append("-")
                continue
            ms = triton.testing.do_bench(
                lambda: quantized_matmul(x, blocks, QUANT_FORMATS["Q4_K"], columns, method=method),  # noqa: B023
                return_mode="median")
            cells.append(f"{ms * 1e3:.1f}")
        dense_ms = triton.testing.do_bench(lambda: x @ dense.T, return_mode="median")  # noqa: B023
        emit([f"| {batch} | " + " | ".join(cells) + f" | {dense_ms * 1e3:.1f} |"])


def q4_k_m_type(tensor: str, layer: int, num_layers: int) -> str:
    """The type llama.cpp's Q4_K_M gives a layer tensor: Q6_K for attn_v and ffn_down in its `use_more_bits`
    layers (the first and last eighth, and every third between), Q4_K elsewhere."""
    more_bits = (layer < num_layers // 8 or layer >= 7 * num_layers // 8
                 or (layer - num_layers // 8) % 3 == 2)
    return "Q6_K" if tensor in ("v_proj", "down_proj") and more_bits else "Q4_K"


def random_q4_k_m_llama(config, device: torch.device):
    """A bf16 Llama of `config` whose linear layers and embeddings are random Q4_K_M-mixed GGUF blocks (the
    output layer Q6_K, the embeddings Q4_K), built without ever holding its dense weights."""
    from localserve.models.layers.linear import QuantizedEmbedding, QuantizedLinear, QuantizedTensor
    from localserve.models.llama import LlamaForCausalLM
    from torch import nn

    generator = torch.Generator(device=device).manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for name, module in list(model.named_modules()):
        parent, _, child = name.rpartition(".")
        if isinstance(module, nn.Linear):
            qtype = "Q6_K" if name == "lm_head" else q4_k_m_type(child, int(name.split(".")[2]), config.num_layers)
            shape = (module.out_features, module.in_features)
            blocks = random_gguf_blocks(qtype, *shape, generator)
            setattr(model.get_submodule(parent), child, QuantizedLinear(QuantizedTensor(blocks, qtype, shape)))
        elif isinstance(module, nn.Embedding):
            shape = (module.num_embeddings, module.embedding_dim)
            blocks = random_gguf_blocks("Q4_K", *shape, generator)
            setattr(model.get_submodule(parent), child,
                    QuantizedEmbedding(QuantizedTensor(blocks, "Q4_K", shape), torch.bfloat16))
    for name, parameter in list(model.named_parameters()):  # the norms
        module, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module), attribute,
                nn.Parameter(torch.ones(parameter.shape, dtype=torch.bfloat16, device=device), requires_grad=False))
    model.init_rope(device)
    return model.eval()


def whole_model_rows(device: torch.device, bandwidth: float, quick: bool, sections: set[str], emit) -> None:
    """Decode tokens/s of a random-weight Llama-3.1-8B-shaped model through the Triton backend: bf16, and
    (with the gguf section) Q4_K_M blocks kept quantized."""
    from localserve.models.llama import LlamaForCausalLM

    config = llama31_8b_config(num_layers=8 if quick else 32)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device=device)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02) if parameter.dim() > 1 else parameter.fill_(1.0)
    model.init_rope(device)
    emit(["", "Whole-model decode, Llama-3.1-8B shapes, random weights, 512-token prompts:", "",
          "| layers | weights | batch | mode | ms / step | tokens/s | roofline steps/s | of roofline "
          "| speed-up over bf16 |", "|---|---|---|---|---|---|---|---|---|"])
    bf16_steps: dict[tuple[int, str], float] = {}
    decode_rows(model, "bf16", bandwidth, quick, bf16_steps, emit)
    if "gguf" in sections:
        del model
        torch.cuda.empty_cache()
        decode_rows(random_q4_k_m_llama(config, device), "Q4_K_M", bandwidth, quick, bf16_steps, emit)


def decode_rows(model, weights: str, bandwidth: float, quick: bool, bf16_steps: dict, emit) -> None:
    """One row per batch and mode (eager, CUDA graphs); bf16 rows fill `bf16_steps`, others divide by it."""
    # A decode step reads every weight but the embeddings' (it gathers a few of their rows).
    weight_bytes = sum(t.numel() * t.element_size() for name, t in (*model.named_parameters(),
                                                                   *model.named_buffers())
                       if "embed_tokens" not in name and "rotary" not in name)
    prompt_len, decode_steps = 512, 32
    for batch in ([1, 16] if quick else BATCHES):
        for mode, max_model_len in (("eager", None), ("graphs", prompt_len + decode_steps + BLOCK_SIZE)):
            step_seconds, kv_bytes = decode_step_seconds(model, batch, prompt_len, decode_steps, max_model_len)
            torch.cuda.empty_cache()
            roofline = bandwidth / 2 / (weight_bytes + kv_bytes)  # the copy bandwidth counts each byte twice
            if weights == "bf16":
                bf16_steps[batch, mode] = step_seconds
            speed_up = f"{bf16_steps[batch, mode] / step_seconds:.2f}x" if (batch, mode) in bf16_steps else "-"
            emit([f"| {model.config.num_layers} | {weights} | {batch} | {mode} | {step_seconds * 1e3:.2f} | "
                  f"{batch / step_seconds:.0f} | {roofline:.0f} | {1 / step_seconds / roofline:.0%} | {speed_up} |"])


def decode_step_seconds(model, batch: int, prompt_len: int, decode_steps: int,
                        max_model_len: int | None) -> tuple[float, int]:
    """(median seconds of a decode step after `batch` prompts, KV bytes it reads): eager, or from CUDA
    graphs (`max_model_len`)."""
    from localserve.engine.model_runner import ModelRunner
    from localserve.engine.step import SeqChunk, StepInput

    config = model.config
    device = next(model.parameters()).device
    blocks_per_seq = (prompt_len + decode_steps + 1) // BLOCK_SIZE + 1
    cache = PagedKVCache(config.num_layers, batch * blocks_per_seq, BLOCK_SIZE, config.num_kv_heads,
                         config.head_dim, torch.bfloat16, device=device)
    runner = ModelRunner(model, cache, TritonAttentionBackend(), max_model_len)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len)).tolist()
    tokens = runner.execute(StepInput([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])).argmax(-1).tolist()
    step_times = []
    for step in range(decode_steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        chunks = [SeqChunk([token], prompt_len + step, table) for token, table in zip(tokens, tables)]
        tokens = runner.execute(StepInput(chunks)).argmax(-1).tolist()  # the host needs the ids: a sync
        step_times.append(time.perf_counter() - start)
    step_seconds = statistics.median(step_times[4:])  # the first steps compile and capture
    return step_seconds, batch * (prompt_len + decode_steps // 2) * cache.bytes_per_token()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a subset: shorter contexts, fewer batches and layers")
    parser.add_argument("--out", type=Path, help="also write the Markdown tables here, row by row")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"which tables, comma-separated, of {', '.join(SECTIONS)} (default: all)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        sys.exit(f"unknown sections {', '.join(sorted(sections - set(SECTIONS)))}; known: {', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA device")
    emit = row_emitter(args.out)

    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    emit([f"Device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"triton {triton.__version__}; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)."])
    if "attention" in sections:
        emit(["", "Decode attention, one layer (bf16 model):", "",
              "| shape | K / V | context | batch | Triton us | cache MB read | GB/s | of copy bw | splits "
              "| torch us | speed-up |", "|---|---|---|---|---|---|---|---|---|---|---|"])
        decode_attention_rows(device, bandwidth, args.quick, emit)
    if "gguf" in sections:
        gguf_rows(device, bandwidth, args.quick, emit)
    if "model" in sections:
        whole_model_rows(device, bandwidth, args.quick, sections, emit)


if __name__ == "__main__":
    main()
