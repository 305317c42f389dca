"""One mixture-of-experts layer's routed experts as the kernels read them, and the plain-torch product over
them: the CPU path, and the reference the fused-MoE kernels (fused_moe.py) are tested against.

Expert e is a gated MLP: y_e(x) = down_e(glu(gate_e x + b, up_e x + b)) + b, where glu is the experts'
`activation`: `silu`, silu(g) * u (SwiGLU: Qwen3-MoE, Mixtral, DeepSeek, GLM, Phi-MoE); `gelu_tanh`,
gelu(g) * u with GELU's tanh approximation (GeGLU: Gemma 4); or `clamped_swiglu`
(gpt-oss), g' * sigmoid(alpha g') * (u' + 1) with g' = min(g, limit) and u' = clamp(u, -limit, limit).
A router (the model's, models/layers) picks k experts per token and their weights; the layer's output for
token t is
sum_j topk_weights[t, j] * y_{topk_ids[t, j]}(x_t). Each projection of all experts is one `ExpertMatrix`:
dense [E, rows, columns] in the model's dtype, or on CUDA a GGUF 3-D tensor's blocks kept as stored
(uint8 [E, rows, row_bytes], gguf_blocks.py), so a 4-bit expert is read at its stored size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from localserve.kernels.gguf_blocks import QuantFormat

ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")  # glu(gate, up), the module doc defines each


@dataclass(frozen=True)
class ExpertMatrix:
    """Every expert's copy of one projection, W_e [rows, columns] for e in 0..E-1 (columns: its inputs)."""

    data: torch.Tensor  # dense [E, rows, columns], or uint8 [E, rows, format.row_bytes(columns)] of `format`
    columns: int
    format: QuantFormat | None = None  # None: dense
    bias: torch.Tensor | None = None  # [E, rows] in the model's dtype

    def __post_init__(self) -> None:
        expected = self.columns if self.format is None else self.format.row_bytes(self.columns)
        if self.data.dim() != 3 or self.data.shape[2] != expected:
            raise ValueError(f"expert weights of shape {tuple(self.data.shape)} do not hold {self.columns} "
                             f"columns{'' if self.format is None else ' of ' + self.format.name + ' blocks'}")
        if self.format is not None and self.data.dtype != torch.uint8:
            raise ValueError(f"{self.format.name} expert blocks must be uint8, not {self.data.dtype}")
        if self.bias is not None and tuple(self.bias.shape) != tuple(self.data.shape[:2]):
            raise ValueError(f"an expert bias of shape {tuple(self.bias.shape)} for weights "
                             f"{tuple(self.data.shape[:2])} x {self.columns}")

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    @property
    def rows(self) -> int:
        return self.data.shape[1]


@dataclass(frozen=True)
class Experts:
    """The routed experts of one layer: gate and up [E, I, H], down [E, H, I]."""

    gate: ExpertMatrix
    up: ExpertMatrix
    down: ExpertMatrix
    activation: str = "silu"
    alpha: float = 1.702  # clamped_swiglu's
    limit: float = 7.0  # clamped_swiglu's

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.activation!r}; known: {', '.join(ACTIVATIONS)}")
        if self.activation == "clamped_swiglu" and not self.limit > 0:
            raise ValueError(f"clamped_swiglu's limit {self.limit} must be positive")
        hidden, intermediate = self.gate.columns, self.gate.rows
        shapes = {(m.num_experts, m.rows, m.columns) for m in (self.gate, self.up)}
        if shapes != {(self.num_experts, intermediate, hidden)} or (
                self.down.num_experts, self.down.rows, self.down.columns) != (self.num_experts, hidden, intermediate):
            raise ValueError("expert projections disagree: gate "
                             f"{self.gate.num_experts}x{self.gate.rows}x{self.gate.columns}, up "
                             f"{self.up.num_experts}x{self.up.rows}x{self.up.columns}, down "
                             f"{self.down.num_experts}x{self.down.rows}x{self.down.columns}")

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    @property
    def hidden_size(self) -> int:
        return self.gate.columns

    @property
    def intermediate_size(self) -> int:
        return self.gate.rows

    @property
    def quantized(self) -> bool:
        return any(m.format is not None for m in (self.gate, self.up, self.down))


def expert_weight(matrix: ExpertMatrix, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """W_expert [rows, columns]: the dense weights in place, or the expert's blocks dequantized to `dtype`
    (by the GGUF kernels: on CUDA, or in Triton's interpreter on the CPU)."""
    if matrix.format is None:
        return matrix.data[expert]
    from localserve.kernels.gguf_matmul import dequantize_rows

    return dequantize_rows(matrix.data[expert].contiguous(), matrix.format, matrix.columns, dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, experts: Experts) -> torch.Tensor:
    """The experts' activation of their gate and up projections (the module doc)."""
    if experts.activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if experts.activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=experts.limit)
    up = up.clamp(-experts.limit, experts.limit)
    return gate * torch.sigmoid(gate * experts.alpha) * (up + 1)


def _project(x: torch.Tensor, matrix: ExpertMatrix, expert: int) -> torch.Tensor:
    out = x @ expert_weight(matrix, expert, x.dtype).T
    return out if matrix.bias is None else out + matrix.bias[expert]


def moe_reference(x: torch.Tensor, experts: Experts, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], topk_ids [T, k] (int), topk_weights [T, k] -> [T, H] in x's dtype.

    Each chosen expert runs once on the tokens that chose it (dense weights are read in place, never
    gathered; quantized ones dequantized, that expert's only: expert_weight); the weighted outputs are
    summed into the tokens' rows in float32.
    """
    num_tokens, top_k = topk_ids.shape
    output = torch.zeros(num_tokens, experts.hidden_size, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start:start + count]  # indices into the flattened [T * k] choices
        start += count
        tokens = picks // top_k
        rows = x[tokens]
        hidden = glu(_project(rows, experts.gate, expert), _project(rows, experts.up, expert), experts)
        out = _project(hidden, experts.down, expert)
        weights = topk_weights.reshape(-1)[picks].to(torch.float32)
        output.index_add_(0, tokens, out.to(torch.float32) * weights[:, None])
    return output.to(x.dtype)
