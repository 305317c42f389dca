"""Tiny random hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) made with transformers' own configs, and a
driver that runs our model on hand-built steps: a paged KV cache for the attention layers, a recurrent
state cache with its `StepStates` for the linear ones, the torch attention backend.

The random weights are wide (logits far from flat) and the linear layers' decays near 1 (A = exp(A_log)
small), so a state carries far: a wrong state shows in the logits long after it was written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK_SIZE = 16
VOCAB = 320
TOLERANCE = 2e-5  # logits' difference from transformers', relative to their largest


def text_fields(**changes) -> dict:
    """The dimensions the tiny configs share: 4 layers (linear, linear, full, linear), head size 32 of which
    a quarter turns, 2 key heads and 4 value heads of 8 in the linear layers."""
    return dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=2048,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    ) | changes


def qwen3_5_config(**changes):
    import transformers

    return transformers.Qwen3_5TextConfig(**text_fields(**changes))


def qwen3_5_moe_config(**changes):
    import transformers

    fields = text_fields(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48) | changes
    fields.pop("intermediate_size", None)
    return transformers.Qwen3_5MoeTextConfig(**fields)


def qwen3_next_config(**changes):
    import transformers

    return transformers.Qwen3NextConfig(**text_fields(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]) | changes)


def save_hybrid(folder: Path, config, seed: int = 0, model_class=None):
    """A random fp32 model of `config` saved by save_pretrained into `folder`; returns the transformers model."""
    import transformers

    torch.manual_seed(seed)
    if model_class is None:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:
        model = model_class._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.2 if param.dim() > 1 else 1.0)
            if param.dim() == 1:
                param.abs_().add_(0.5)
            if name.endswith("A_log"):  # decays exp(-A softplus(.)) near 1: long memory
                param.uniform_(-4.0, -2.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    return model


def transformers_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' uncached forward logits [P, V]."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt]), use_cache=False).logits[0].float()


def assert_close_logits(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Our logits within TOLERANCE of transformers'; returns the largest difference."""
    difference = (ours - theirs).abs().max().item()
    assert difference <= TOLERANCE * theirs.abs().max().item(), (difference, theirs.abs().max().item())
    return difference


@dataclass
class Chunk:
    """One sequence's part of a step: its new tokens from `start`, the slot its state is read from (-1:
    zeros), the (tokens after which, slot) saves, its KV block table."""

    tokens: list[int]
    start: int
    read_slot: int
    saves: list[tuple[int, int]]
    table: list[int]
    held: bool = False  # a verify row: its states wait for `HybridDriver.settle`


class HybridDriver:
    """Our loaded model run step by step on hand-built contexts (module doc)."""

    def __init__(self, model, num_blocks: int = 32, num_slots: int = 16) -> None:
        """KV and conv inputs in the model's dtype, the delta-rule matrices in float32."""
        from localserve.attention.torch_backend import TorchAttentionBackend
        from localserve.engine.builder import layer_kv_shapes
        from localserve.kv.cache import PagedKVCache
        from localserve.kv.recurrent_states import RecurrentStateCache

        config, dtype = model.config, next(model.parameters()).dtype
        self.model = model
        self.kv_cache = PagedKVCache(config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads,
                                     config.head_dim, dtype, layer_shapes=layer_kv_shapes(config))
        self.states = RecurrentStateCache(config.recurrent_layers, config.linear_attention.state, num_slots, dtype)
        self.backend = TorchAttentionBackend()

    @torch.inference_mode()
    def step(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run one step of these chunks; returns the logits of every token [T, V], chunk after chunk."""
        from localserve.models.protocol import ForwardContext

        from localserve.attention.base import AttentionInputs
        from localserve.kv.recurrent_states import StepStates

        positions = torch.cat([torch.arange(c.start, c.start + len(c.tokens)) for c in chunks])
        width = max(len(c.table) for c in chunks)
        tables = torch.tensor([c.table + [0] * (width - len(c.table)) for c in chunks], dtype=torch.int64)
        seq_of_token = torch.cat([torch.full((len(c.tokens),), i) for i, c in enumerate(chunks)])
        slots = tables[seq_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        inputs = AttentionInputs(slots, positions, tables, [len(c.tokens) for c in chunks],
                                 [c.start + len(c.tokens) for c in chunks], BLOCK_SIZE)
        states = StepStates(self.states, torch.tensor([c.read_slot for c in chunks], dtype=torch.int64),
                            [list(c.saves) for c in chunks], frozenset(i for i, c in enumerate(chunks) if c.held))
        self.held = states
        ctx = ForwardContext(self.backend, self.kv_cache, self.backend.build_metadata(inputs), states)
        input_ids = torch.tensor([t for c in chunks for t in c.tokens])
        return self.model.compute_logits(self.model(input_ids, positions, ctx))

    def settle(self, kept: dict[int, int]) -> None:
        """The last step's held chunks (by place) keep their first `kept[i]` tokens: their states written."""
        self.held.settle(kept)

    def prefill_in_pieces(self, prompt: list[int], cuts: list[int], table: list[int], slot: int = 0,
                          first_read: int = -1) -> torch.Tensor:
        """The prompt as consecutive chunks cut at `cuts`, its running state in `slot` (read from `first_read`
        by the first chunk); returns the logits of every token [P, V]."""
        bounds = [0, *cuts, len(prompt)]
        logits = []
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            read = first_read if i == 0 else slot
            logits.append(self.step([Chunk(prompt[lo:hi], lo, read, [(hi - lo, slot)], table)]))
        return torch.cat(logits)

    def state(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of `slot`'s conv inputs and matrices in `layer`."""
        return self.states.conv[layer][slot].clone(), self.states.matrix[layer][slot].clone()
