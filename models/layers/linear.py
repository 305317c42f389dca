"""Linear layers and embeddings whose weight stays a GGUF tensor's quantized blocks on the device.

The blocks are llama.cpp's own bytes, unchanged (`uint8 [out_features, row_bytes]`); the Triton kernels of
`localserve.kernels.gguf_matmul` dequantize them inside the product, so a 4-bit weight is read at its
stored size in every step. An embedding gathers and dequantizes only the rows of the step's tokens, and
a tied output layer multiplies with the same blocks. The kernels (and so Triton) are imported only
when a layer first runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from localserve.kernels.gguf_blocks import QUANT_FORMATS
from torch import nn


@dataclass
class QuantizedTensor:
    """A weight as its GGUF blocks: uint8 [rows, row_bytes] of GGML type `qtype` (e.g. "Q4_K"), or a stack of
    experts' weights uint8 [experts, rows, row_bytes]."""

    blocks: torch.Tensor
    qtype: str
    shape: tuple[int, ...]  # of the weight: (out_features, in_features), or (experts, rows, columns)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b), with W [out_features, in_features] held as its GGUF blocks."""

    def __init__(self, weight: QuantizedTensor, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.format = QUANT_FORMATS[weight.qtype]
        self.out_features, self.in_features = weight.shape
        if weight.blocks.shape != (self.out_features, self.format.row_bytes(self.in_features)):
            raise ValueError(f"{weight.qtype} blocks of shape {tuple(weight.blocks.shape)} do not hold a "
                             f"{self.out_features} x {self.in_features} weight")
        self.register_buffer("blocks", weight.blocks)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from localserve.kernels.gguf_matmul import quantized_matmul

        out = quantized_matmul(x, self.blocks, self.format, self.in_features)
        return out if self.bias is None else out + self.bias

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out_features, in_features] in `dtype` (for checks and references, not for the forward pass)."""
        from localserve.kernels.gguf_matmul import dequantize_rows

        return dequantize_rows(self.blocks, self.format, self.in_features, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={self.format.name}, "
                f"bias={self.bias is not None}")


class QuantizedEmbedding(QuantizedLinear):
    """Token embeddings [num_embeddings, embedding_dim] as GGUF blocks: forward gathers rows; `linear`
    multiplies with the same blocks (a tied output layer)."""

    def __init__(self, weight: QuantizedTensor, dtype: torch.dtype) -> None:
        super().__init__(weight)
        self.dtype = dtype  # of the gathered rows: the model's

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        from localserve.kernels.gguf_matmul import dequantize_rows

        rows = dequantize_rows(self.blocks, self.format, self.in_features, self.dtype, rows=token_ids.reshape(-1))
        return rows.reshape(*token_ids.shape, self.in_features)

    def linear(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., embedding_dim] @ E^T -> [..., num_embeddings]."""
        return super().forward(hidden)
