"""Tiny random models written by the tests, in every supported architecture, and runners over them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHITECTURES = {
    # name: (transformers config class, extra config)
    "llama": ("LlamaConfig", {}),
    "llama3.1": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama-linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "smollm2": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 100000.0}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2-yarn": ("Qwen2Config", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32}}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    # 8 experts, 3 a token, renormalised; layer 1 dense (mlp_only_layers); saved one tensor per expert
    "qwen3-moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 3,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}),
}


def write_tiny_model(folder: Path, arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, num_layers: int = 2,
                     vocab_size: int = 256):
    """Write a random tiny model of `arch` with transformers' own save_pretrained; returns the HF model."""
    import transformers

    config_class, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_class)(**(dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        rms_norm_eps=1e-6) | extra))
    return save_random_model(folder, config, seed, dtype)


def save_random_model(folder: Path, config, seed: int = 0, dtype: torch.dtype = torch.float32, model_class=None,
                      **save_options):
    """A transformers model of `config` (`model_class`, else the causal LM transformers maps it to) with wide
    random weights, saved by save_pretrained (given `save_options`, e.g. max_shard_size) into `folder`."""
    import transformers

    torch.manual_seed(seed)
    if model_class is None:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        model = model_class._from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # random init is tiny; widen it so logits are far from flat and ties rare
        for param in model.parameters():
            param.normal_(0, 0.2 if param.dim() > 1 else 1.0)
            if param.dim() == 1:
                param.abs_().add_(0.5)
    model.save_pretrained(folder, safe_serialization=True, **save_options)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    return model


def make_runner(source, dtype=torch.float32, num_blocks=16, block_size=16, keep_quantized_weights=None):
    """The model in `source` (a path, or a LoadedModel) loaded by localserve, and a torch-backend
    ModelRunner over a fresh pool."""
    from localserve.attention.torch_backend import TorchAttentionBackend
    from localserve.engine.builder import layer_kv_shapes
    from localserve.engine.model_runner import ModelRunner
    from localserve.kv.cache import PagedKVCache
    from localserve.loading.hf import LoadedModel, load_model

    if isinstance(source, LoadedModel):
        loaded = source
    else:
        loaded = load_model(source, dtype=dtype, keep_quantized_weights=keep_quantized_weights)
    config = loaded.config
    cache = PagedKVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype,
                         layer_shapes=layer_kv_shapes(config))
    return loaded, ModelRunner(loaded.model, cache, TorchAttentionBackend())


def greedy_paged(runner, prompt: list[int], num_tokens: int, block_table: list[int],
                 collected_logits: list | None = None) -> list[int]:
    """Greedy decoding through the paged cache: prefill once, then one token per step. The logits of
    every step (the prompt's [P, V], then [1, V] each) are appended to `collected_logits` if given."""
    from localserve.engine.step import SeqChunk, StepInput

    logits = runner.prompt_logits(prompt, block_table)
    tokens = [int(logits[-1].argmax())]
    steps = [logits]
    while len(tokens) < num_tokens:
        pos = len(prompt) + len(tokens) - 1
        step = StepInput([SeqChunk([tokens[-1]], pos, block_table)])
        steps.append(runner.execute(step))
        tokens.append(int(steps[-1][0].argmax()))
    if collected_logits is not None:
        collected_logits.extend(steps)
    return tokens


def assert_matches_transformers(runner, hf_model, prompt: list[int], block_table: list[int],
                                tolerance: float = 1e-4, num_tokens: int = 12) -> None:
    """localserve's logits over `prompt` (paged through `block_table`) within `tolerance` of transformers',
    and `num_tokens` greedy tokens the same as transformers' generate."""
    ours = runner.prompt_logits(prompt, block_table)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0].float()
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert (ours - theirs).abs().max().item() < tolerance
    assert greedy_paged(runner, prompt, num_tokens, block_table) == expected
