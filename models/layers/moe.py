"""The mixture-of-experts MLP: a router (routers.py) picks k routed experts per token and weighs them; the
experts are gated MLPs held per projection as stacked tensors [E, rows, columns] (dense, or a GGUF's
blocks kept as stored); a shared expert (a gated MLP every token goes through, optionally scaled by
sigmoid(w . x)) adds its output.

The product over the routed experts is kernels/moe_experts.py's contract: on CUDA the fused Triton kernels
(`localserve.kernels.fused_moe`) when they can be imported; on the CPU the plain-torch `moe_reference`.
"""

from __future__ import annotations

import functools

import torch
from localserve.kernels.gguf_blocks import QUANT_FORMATS
from localserve.kernels.moe_experts import ExpertMatrix, Experts, moe_reference
from localserve.models.config import MoEConfig
from localserve.models.layers.linear import QuantizedTensor
from localserve.models.layers.mlp import GatedMLP
from localserve.models.layers.routers import route
from torch import nn

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@functools.cache
def fused_moe_kernel():
    """`localserve.kernels.fused_moe.fused_moe`, or None where it cannot be imported (no Triton)."""
    try:
        from localserve.kernels.fused_moe import fused_moe
    except ImportError:
        return None
    return fused_moe


class RoutedExperts(nn.Module):
    """E experts' gate and up [E, I, H] and down [E, H, I] projections (with biases [E, rows] where the family
    has them), named as transformers 5 names them (`mlp.experts.down_proj`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation  # of the gate: kernels/moe_experts.py's ACTIVATIONS
        shapes = {"gate_proj": (intermediate_size, hidden_size), "up_proj": (intermediate_size, hidden_size),
                  "down_proj": (hidden_size, intermediate_size)}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(num_experts, *shape)))
            if bias:
                setattr(self, name.replace("_proj", "_bias"), nn.Parameter(torch.empty(num_experts, shape[0])))
        self.columns = {name: shape[1] for name, shape in shapes.items()}
        self.formats: dict[str, str] = {}  # projection -> GGML type of the blocks it keeps

    def keep_quantized(self, projection: str, weight: QuantizedTensor) -> None:
        """Hold `projection` as its GGUF blocks uint8 [E, rows, row_bytes] (the loader's call)."""
        if projection not in PROJECTIONS:
            raise ValueError(f"{projection!r} is not an expert projection ({', '.join(PROJECTIONS)})")
        delattr(self, projection)
        self.register_buffer(projection, weight.blocks)
        self.formats[projection] = weight.qtype

    @property
    def quantized(self) -> bool:
        return bool(self.formats)

    def experts(self) -> Experts:
        """The kernels' view of these experts."""
        matrices = []
        for name in PROJECTIONS:
            qtype = self.formats.get(name)
            matrices.append(ExpertMatrix(getattr(self, name), self.columns[name],
                                         None if qtype is None else QUANT_FORMATS[qtype],
                                         getattr(self, name.replace("_proj", "_bias"), None)))
        return Experts(*matrices, activation=self.activation)


class MoE(nn.Module):
    """Router, routed experts and an optional shared expert; `gate` is the router (Hugging Face's name)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, bias: bool = False) -> None:
        super().__init__()
        self.config = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=moe.router_bias)
        if moe.selection_bias:
            self.selection_bias = nn.Parameter(torch.empty(moe.num_experts))
        self.experts = RoutedExperts(moe.num_experts, hidden_size, moe.intermediate_size, moe.expert_bias)
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_intermediate_size, bias)
            if moe.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    @property
    def supports_cuda_graphs(self) -> bool:
        """The torch path reads the experts' token counts on the host; only the fused kernels can be captured."""
        return fused_moe_kernel() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, ids = route(self.gate(x), self.config, getattr(self, "selection_bias", None))
        out = run_experts(x, self.experts.experts(), ids, weights)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x)
            if hasattr(self, "shared_expert_gate"):
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def run_experts(x: torch.Tensor, experts: Experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t): the fused kernels on CUDA where they are
    there; the torch path otherwise (which dequantizes quantized experts one chosen expert at a time)."""
    fused_moe = fused_moe_kernel() if x.device.type == "cuda" else None
    if fused_moe is not None:
        return fused_moe(x, experts, topk_ids, topk_weights)
    return moe_reference(x, experts, topk_ids, topk_weights)
