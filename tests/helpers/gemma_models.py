"""Tiny random Gemma 3 and Gemma 4 configs (transformers' own config classes) with windows of 16 tokens, so
that prompts and generations of a few dozen tokens cross them several times."""

from __future__ import annotations

import torch

WINDOW = 16


def gemma3_config(**changes):
    """6 layers (5 sliding, 1 full: the pattern llama.cpp assumes), GQA 4 / 2, query_pre_attn_scalar unlike
    the head size, linear rope scaling on the full layer, soft-capped logits."""
    import transformers

    return transformers.Gemma3TextConfig(**(dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, eos_token_id=1,
        bos_token_id=2, pad_token_id=0, max_position_embeddings=2048) | changes))


def gemma4_config(moe: bool = False, **changes):
    """4 layers (3 sliding, the last full): the full layer with head size 32 (twice the sliding ones'), one KV
    head, no value projection (attention_k_eq_v) and proportional rope on a quarter of its head; with `moe`,
    4 experts (2 a token) beside the dense MLP in every layer."""
    import transformers

    experts = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32) if moe else {}
    return transformers.Gemma4TextConfig(**(dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], eos_token_id=1, bos_token_id=2,
        pad_token_id=0, max_position_embeddings=2048) | experts | changes))


def write_byte_fallback_tokenizer(folder, vocab_size: int) -> None:
    """A sentencepiece-style BPE tokenizer.json (byte fallback, `▁` for spaces: what llama.cpp's converter
    reads Gemma 4's vocabulary as) of exactly `vocab_size` tokens: <pad> <eos> <bos> <unk>, the 256 bytes,
    then single characters; no merges."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = specials + [f"<0x{byte:02X}>" for byte in range(256)]
    pieces += [chr(code) for code in range(ord("!"), ord("!") + vocab_size - len(pieces) - 1)] + ["▁"]
    backend = Tokenizer(models.BPE({piece: i for i, piece in enumerate(pieces)}, [], unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(specials)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>"}))


def greedy_without_cache(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy tokens, each from a whole forward pass over the sequence so far (no KV cache)."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            sequence.append(int(hf_model(torch.tensor([sequence]), use_cache=False).logits[0, -1].argmax()))
    return sequence[len(prompt):]


def assert_matches_without_cache(runner, hf_model, prompt: list[int], block_table: list[int],
                                 num_tokens: int = 4) -> None:
    """localserve's logits over `prompt` within 1e-4 of transformers', and its greedy tokens those of
    transformers' forward passes without a KV cache (`greedy_without_cache`)."""
    from tests.helpers.models import greedy_paged

    ours = runner.prompt_logits(prompt, block_table)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0]
    assert (ours - theirs).abs().max() < 1e-4
    assert greedy_paged(runner, prompt, num_tokens, block_table) == greedy_without_cache(hf_model, prompt, num_tokens)
