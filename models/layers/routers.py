"""Mixture-of-experts routers: each token's k experts and their weights from the router's logits.

The kinds (MoEConfig.router):
- `softmax_topk` (Qwen2/3-MoE, Qwen3.5/3.6): p = softmax(logits); the k largest p; with `normalize` the k
  weights are divided by their sum (Qwen3-MoE's `norm_topk_prob`), else they are the p themselves.
- `topk_softmax` (Mixtral, gpt-oss): the k largest logits; weights = softmax over those k logits (the same
  as softmax then top-k then renormalising).
- `sigmoid_grouped` (DeepSeek-V3, GLM-4.x): s = sigmoid(logits); choice = s + selection bias (the bias
  chooses, never weighs). Experts sit in `num_groups` equal groups; a group scores the sum of its two best
  choices, and only the `topk_groups` best groups are chosen from (their other experts never); the k best
  choices there are taken, weighted by their s, divided by their sum with `normalize`, times
  `routed_scaling_factor`.

Ties are broken by the lower expert (or group) index: selection is a stable sort, not `torch.topk`, whose
order among equal values is left unspecified. Weights are float32.
"""

from __future__ import annotations

import torch
from localserve.models.config import MoEConfig


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k largest of scores [..., N], the lower index first among equal values."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def route(logits: torch.Tensor, moe: MoEConfig,
          selection_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), in order of preference."""
    logits = logits.float()
    if moe.router == "softmax_topk":
        probs = logits.softmax(dim=-1)
        ids = top_k(probs, moe.top_k)
        weights = probs.gather(-1, ids)
        if moe.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if moe.router == "topk_softmax":
        ids = top_k(logits, moe.top_k)
        return logits.gather(-1, ids).softmax(dim=-1), ids
    return _sigmoid_grouped(logits, moe, selection_bias)


def _sigmoid_grouped(logits: torch.Tensor, moe: MoEConfig,
                     selection_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.sigmoid()
    choice = scores if selection_bias is None else scores + selection_bias.float()
    if moe.num_groups > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, moe.num_groups, num_experts // moe.num_groups)
        best_two = grouped.sort(dim=-1, descending=True).values[..., :min(2, grouped.shape[-1])]
        groups = top_k(best_two.sum(dim=-1), moe.topk_groups)  # [T, topk_groups]
        allowed = torch.zeros(num_tokens, moe.num_groups, dtype=torch.bool, device=choice.device)
        allowed.scatter_(1, groups, True)
        choice = grouped.masked_fill(~allowed[..., None], float("-inf")).view(num_tokens, num_experts)
    ids = top_k(choice, moe.top_k)
    weights = scores.gather(-1, ids)
    if moe.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids
