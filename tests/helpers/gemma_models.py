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


# A scripted Gemma 4 model (the idea of tests/helpers/scripted.py in Gemma 4's shapes) that calls a tool through
# the real chat template: its greedy output follows the prompt's last token only. Its one (full-attention)
# layer adds nothing (the attention's and the MLP's output projections are zero, so are their post-norms'
# inputs), the embedding is the identity (times sqrt(hidden), undone by the final norm) and the head maps each
# token to its successor: the empty thought block that ends the template's prompt with thinking off
# (`<channel|>`) leads to a call of get_weather with days 2, then to `<|tool_response>` (an end of generation).
# The call's pieces are their text's only tokenization (merges build them): llguidance masks text the grammar
# forces (`call:get_weather{` after the call's token) to the tokenizer's own spelling of it.
TOOL_VOCAB = 64  # = hidden size: the identity embedding gives each token its own direction
TOOL_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", '<|"|>',
                 "<|channel>", "<channel|>", "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>",
                 "<|think|>"]
TOOL_PIECES = ["call:get_weather{days:", "2}"]


def merged_piece_tokenizer(specials: list[str], pieces: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (no pre-tokenizer splits) whose merges build each of `pieces` (ASCII) from its
    characters: ids 0.. the `specials`, then each piece, then the characters and the pieces' prefixes, then
    fillers. Each piece is its own text's only tokenization, as llguidance spells text a grammar forces."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(specials)}
    merges = []
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    for piece in pieces:
        for char in piece:
            vocab.setdefault(char, len(vocab))
        for end in range(2, len(piece) + 1):
            vocab.setdefault(piece[:end], len(vocab))
            merges.append((piece[:end - 1], piece[end - 1]))
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), vocab_size)})
    assert len(vocab) == vocab_size, len(vocab)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return backend


def write_tool_calling_gemma4(folder, chat_template: str):
    """The model's folder (config, weights, tokenizer with `chat_template`)."""
    import json

    from safetensors.torch import save_file

    from tests.helpers.scripted import SUCCESSOR_LOGIT

    ids = {text: i for i, text in enumerate(TOOL_SPECIALS)}
    folder.mkdir(parents=True, exist_ok=True)
    merged_piece_tokenizer(TOOL_SPECIALS, TOOL_PIECES, TOOL_VOCAB).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
         "chat_template": chat_template}))
    end = ids["<|tool_response>"]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, ids["<turn|>"], end]}))
    first, second = len(TOOL_SPECIALS), len(TOOL_SPECIALS) + 1
    successor = {ids["<channel|>"]: ids["<|tool_call>"], ids["<|tool_call>"]: first, first: second,
                 second: ids["<tool_call|>"], ids["<tool_call|>"]: end}
    hidden, heads, head_dim = TOOL_VOCAB, 2, 16
    config = gemma4_config(vocab_size=TOOL_VOCAB, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                           num_key_value_heads=heads, head_dim=head_dim, global_head_dim=head_dim,
                           num_global_key_value_heads=heads, attention_k_eq_v=False, final_logit_softcapping=None,
                           layer_types=["full_attention"], tie_word_embeddings=False, eos_token_id=1).to_dict()
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["Gemma4ForCausalLM"]}))
    head = torch.zeros(TOOL_VOCAB, hidden)
    for token, nxt in successor.items():  # the final norm of sqrt(hidden) times a one-hot row is sqrt(hidden) times it
        head[nxt, token] = SUCCESSOR_LOGIT / hidden ** 0.5
    layer = "model.layers.0."
    weights = {"model.embed_tokens.weight": torch.eye(TOOL_VOCAB, hidden), "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": head, layer + "layer_scalar": torch.ones(1)}
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        weights[f"{layer}{norm}.weight"] = torch.ones(hidden)
    for norm in ("q_norm", "k_norm"):
        weights[f"{layer}self_attn.{norm}.weight"] = torch.ones(head_dim)
    for name, shape in (("q_proj", (heads * head_dim, hidden)), ("k_proj", (heads * head_dim, hidden)),
                        ("v_proj", (heads * head_dim, hidden)), ("o_proj", (hidden, heads * head_dim)),
                        ("mlp.gate_proj", (96, hidden)), ("mlp.up_proj", (96, hidden)),
                        ("mlp.down_proj", (hidden, 96))):
        weights[f"{layer}{'' if name.startswith('mlp') else 'self_attn.'}{name}.weight"] = torch.zeros(shape)
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def check_generated_config(folder, config, length: int, seed: int, block_table: list[int]) -> None:
    """A random model of `config` saved in `folder`, loaded by localserve, against transformers over a random
    prompt of `length` tokens (`assert_matches_without_cache`)."""
    from tests.helpers.models import make_runner, save_random_model

    hf_model = save_random_model(folder, config, seed=seed)
    _, runner = make_runner(folder)
    prompt = torch.randint(3, config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    assert_matches_without_cache(runner, hf_model, prompt, block_table)
