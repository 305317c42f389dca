"""Random routed experts (dense, or random valid GGUF blocks beside their `gguf.quants` dequantization) and
routings with uneven loads, for the mixture-of-experts kernels' tests."""

from __future__ import annotations

import gguf
import torch
from localserve.kernels.gguf_blocks import QUANT_FORMATS
from localserve.kernels.moe_experts import ExpertMatrix, Experts

from tests.helpers.gguf import random_blocks
from tests.helpers.kv_pools import DEVICE

DENSE_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def expert_shape(qtype: str) -> tuple[int, int]:
    """(hidden, intermediate) for experts of `qtype`: small, and neither a power of two of blocks where a
    block holds 32 values (a tile overhangs the row); K-quants need 256 columns a row."""
    if qtype in DENSE_TYPES:
        return 48, 80
    return (256, 256) if QUANT_FORMATS[qtype].block_values == 256 else (64, 96)


def random_experts(qtype: str, num_experts: int, hidden: int, intermediate: int, seed: int = 0,
                   biases: bool = False) -> tuple[Experts, Experts]:
    """(the experts as the kernels take them, on DEVICE; the same weights dense in float32 on the CPU: for
    GGUF types `gguf.quants.dequantize` of the blocks). `qtype`: bf16, fp16, fp32 or a GGML type name."""
    generator = torch.Generator().manual_seed(seed)
    kernel_side, reference_side = [], []
    for index, (rows, columns) in enumerate(((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))):
        bias = torch.randn(num_experts, rows, generator=generator) * 0.1 if biases else None
        if qtype in DENSE_TYPES:
            dense = (torch.randn(num_experts, rows, columns, generator=generator) / columns ** 0.5).to(
                DENSE_TYPES[qtype])
            data, fmt, reference = dense, None, dense.float()
        else:
            fmt = QUANT_FORMATS[qtype]
            blocks = random_blocks(qtype, num_experts * rows, columns, seed=seed * 10 + index,
                                   magnitude=2 / columns ** 0.5)
            reference = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]))
            data, reference = torch.from_numpy(blocks).reshape(num_experts, rows, -1), reference.float()
            reference = reference.reshape(num_experts, rows, columns)
        dtype = DENSE_TYPES.get(qtype, torch.float32)
        kernel_bias = None if bias is None else bias.to(dtype).to(DEVICE)
        kernel_side.append(ExpertMatrix(data.to(DEVICE), columns, fmt, kernel_bias))
        reference_side.append(ExpertMatrix(reference, columns, None, None if bias is None else bias.to(dtype).float()))
    return Experts(*kernel_side), Experts(*reference_side)


def uneven_routes(num_tokens: int, num_experts: int, top_k: int, seed: int = 0,
                  popular: int | None = 0, unused: int | None = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int64, topk_weights [T, k] float32 summing to 1 per token): k distinct experts per
    token at random, except that expert `popular` is chosen by every token (at a random one of its k
    places) and expert `unused` by none (negative: counted from the end; None: no such expert)."""
    generator = torch.Generator().manual_seed(seed)
    unused = None if unused is None else unused % num_experts
    others = [e for e in range(num_experts) if e not in (popular, unused)]
    rows = []
    for _ in range(num_tokens):
        pick = torch.randperm(len(others), generator=generator)[:top_k - (popular is not None)]
        row = [others[i] for i in pick.tolist()] + ([] if popular is None else [popular])
        rows.append([row[i] for i in torch.randperm(len(row), generator=generator).tolist()])
    ids = torch.tensor(rows, dtype=torch.int64).reshape(num_tokens, top_k)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), dim=-1)
    return ids, weights
