"""A scripted Qwen3-MoE model (the idea of tests/helpers/scripted.py in Qwen3-MoE's shapes) that calls a tool
through a real chat template: its greedy output follows the prompt's last token only.

Its one layer adds nothing (attention's output projection, the router and every expert are zero; q/k norms
one), the embedding is the identity and the head maps each token to its successor: the newline that ends
the template's generation prompt (`<|im_start|>assistant\\n`) leads to a Hermes call of get_weather, then to
`<|im_end|>`. The vocabulary holds the call's two pieces (cut where the tool-call grammar leaves a choice,
tests/helpers/tool_models.py), the single characters a grammar spells JSON with, and ChatML's markers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.helpers.scripted import SUCCESSOR_LOGIT, piece_tokenizer
from tests.helpers.tool_models import SINGLE_CHARACTERS, hermes_call

VOCAB = 64  # = hidden size: the identity embedding gives each token its own direction
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
EOS = 2
WEATHER = hermes_call("get_weather", {"city": "Paris"})
CUT = WEATHER.index("Par") + 3
CALL_PIECES = [WEATHER[:CUT], WEATHER[CUT:]]


def write_tool_calling_qwen3_moe(folder: Path, chat_template: str) -> Path:
    """The model's folder (config, weights, tokenizer with `chat_template`)."""
    pieces = [piece.encode() for piece in CALL_PIECES] + [char.encode() for char in SINGLE_CHARACTERS + "\n"]
    pieces += [f"<unused{i}>".encode() for i in range(len(SPECIALS) + len(pieces), VOCAB)]
    backend = piece_tokenizer(SPECIALS, pieces)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": chat_template}))
    first, second = len(SPECIALS), len(SPECIALS) + 1
    newline = len(SPECIALS) + pieces.index(b"\n")
    _write_weights(folder, {newline: first, first: second, second: EOS})
    return folder


def _write_weights(folder: Path, successor: dict[int, int]) -> None:
    hidden, heads, head_dim, experts, expert_size = VOCAB, 4, 16, 4, 16
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB,
              "hidden_size": hidden, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": heads,
              "num_key_value_heads": heads, "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": 2,
              "moe_intermediate_size": expert_size, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 1024, "eos_token_id": EOS, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    head = torch.zeros(VOCAB, hidden)
    for token, nxt in successor.items():  # RMSNorm of a one-hot row is sqrt(hidden) times it
        head[nxt, token] = SUCCESSOR_LOGIT / hidden ** 0.5
    layer = "model.layers.0."
    weights = {"model.embed_tokens.weight": torch.eye(VOCAB, hidden), "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": head, layer + "input_layernorm.weight": torch.ones(hidden),
               layer + "post_attention_layernorm.weight": torch.ones(hidden),
               layer + "self_attn.q_norm.weight": torch.ones(head_dim),
               layer + "self_attn.k_norm.weight": torch.ones(head_dim),
               layer + "mlp.gate.weight": torch.zeros(experts, hidden),
               layer + "mlp.experts.gate_up_proj": torch.zeros(experts, 2 * expert_size, hidden),
               layer + "mlp.experts.down_proj": torch.zeros(experts, hidden, expert_size)}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        weights[f"{layer}self_attn.{name}.weight"] = torch.zeros(heads * head_dim, hidden)
    save_file(weights, str(folder / "model.safetensors"))
