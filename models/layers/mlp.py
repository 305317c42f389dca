"""The gated MLP: down(act(gate x) * up x), with act SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""

from __future__ import annotations

import torch
from torch import nn

ACTIVATIONS = {"silu": nn.functional.silu,
               "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
