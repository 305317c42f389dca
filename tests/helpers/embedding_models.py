"""Tiny random Qwen3 embedding models as Qwen3-Embedding ships them: the bare decoder's weights (no
`model.` prefix, no LM head) under `Qwen3ForCausalLM`, and sentence-transformers' modules.json,
1_Pooling/config.json and a Normalize module; with the server tests' word-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.server import SPECIAL_TOKENS, VOCAB_SIZE, WORDS

POOLING_FLAGS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def write_tiny_embedding_model(folder: Path, pooling: str = "last", normalize: bool = True, seed: int = 0):
    """Write the model; returns transformers' `Qwen3Model` of the same weights (the reference)."""
    import transformers
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models, pre_tokenizers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():  # widened as tests/helpers/models.py does, so the vectors are far from flat
        for param in model.parameters():
            param.normal_(0, 0.2 if param.dim() > 1 else 1.0)
            if param.dim() == 1:
                param.abs_().add_(0.5)
    model.save_pretrained(folder, safe_serialization=True)
    hf_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(hf_config | {"architectures": ["Qwen3ForCausalLM"]}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    flags = {flag: name == pooling for name, flag in POOLING_FLAGS.items()}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags,
                                                                   "pooling_mode_max_tokens": False,
                                                                   "include_prompt": True}))
    words = WORDS + [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(WORDS))]
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + words)}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>",
                                                              "unk_token": "<unk>"}))
    return model


def reference_embedding(model, token_ids: list[int], pooling: str, normalize: bool = True,
                        dimensions: int | None = None) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) of one prompt, pooled the same way."""
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids])).last_hidden_state[0].float()
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    if dimensions is not None:
        pooled = pooled[:dimensions]
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float64),
                                                       torch.as_tensor(b, dtype=torch.float64), dim=0))
