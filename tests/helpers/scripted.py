"""A scripted model: a real (tiny) Llama folder whose greedy output is a script of token texts chosen by
the test, so stop rules can be tested at exact token and byte boundaries.

The model's single layer adds nothing (its output projections are zero), the embedding is the identity
and the head maps token t to the script's successor of t with a logit of 32 (every other token gets 0),
so the next token depends only on the last one: even sampled at temperature 1 the script is followed
(the successor carries all but ~1e-12 of the probability). The tokenizer is byte-level BPE whose token i
decodes to any bytes the test gives it, so a multi-byte character can be split over tokens at will.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

VOCAB = 64  # = hidden size, so the identity embedding gives each token its own direction
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0-2; </s> (2) is the end of sequence
BOS, EOS = 1, 2
FIRST_PIECE = len(SPECIALS)
SUCCESSOR_LOGIT = 32.0


@dataclass
class Script:
    """Where a scripted model lives, and the ids its pieces got."""

    folder: Path
    piece_ids: list[int]  # pieces[i] is token piece_ids[i]
    prompt: list[int]  # BOS: the model then produces the pieces in order


def _byte_level(data: bytes) -> str:
    """A byte string as the byte-level alphabet spells it (what a ByteLevel decoder turns back into bytes)."""
    alphabet = _bytes_to_unicode()
    return "".join(alphabet[b] for b in data)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte <-> printable-character table, which tokenizers' ByteLevel decoder inverts.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def piece_tokenizer(specials: list[str], pieces: list[bytes]) -> BackendTokenizer:
    """A byte-level BPE tokenizer without merges: ids 0.. the `specials` (added as special tokens), then one
    token per piece (whose bytes it decodes to), in order."""
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({_byte_level(piece): i for i, piece in enumerate(pieces, start=len(specials))})
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return backend


def write_scripted_model(folder: Path, pieces: list[bytes | str], then: str = "eos",
                         generation_eos: list[int] | None = None, context_length: int = 256) -> Script:
    """Write the folder (config, weights, tokenizer) of a model that says `pieces` in order after BOS.

    `then`: what follows the last piece: "eos", or "loop" (back to the first piece). After EOS the
    model starts the pieces again (seen only with `ignore_eos`). `generation_eos` is written as
    generation_config.json's eos_token_id (config.json keeps EOS alone).
    """
    data = [p.encode() if isinstance(p, str) else p for p in pieces]
    assert len(set(data)) == len(data), "each piece is its own token: pieces must differ"
    assert FIRST_PIECE + len(data) <= VOCAB
    piece_ids = list(range(FIRST_PIECE, FIRST_PIECE + len(data)))
    fillers = [f"<unused{i}>".encode() for i in range(FIRST_PIECE + len(data), VOCAB)]
    backend = piece_tokenizer(SPECIALS, data + fillers)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))

    successor = {BOS: piece_ids[0], EOS: piece_ids[0]}
    successor.update(zip(piece_ids, piece_ids[1:]))
    successor[piece_ids[-1]] = EOS if then == "eos" else piece_ids[0]
    _write_weights(folder, successor, context_length)
    return Script(folder, piece_ids, [BOS])


def _write_weights(folder: Path, successor: dict[int, int], context_length: int) -> None:
    hidden, heads, intermediate = VOCAB, 4, 32
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": heads, "rms_norm_eps": 1e-6,
              "max_position_embeddings": context_length, "bos_token_id": BOS, "eos_token_id": EOS,
              "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    # RMSNorm of a one-hot row is sqrt(hidden) times it; the head undoes that scale.
    head = torch.zeros(VOCAB, hidden)
    for token, nxt in successor.items():
        head[nxt, token] = SUCCESSOR_LOGIT / hidden ** 0.5
    layer = "model.layers.0."
    weights = {"model.embed_tokens.weight": torch.eye(VOCAB, hidden), "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": head, layer + "input_layernorm.weight": torch.ones(hidden),
               layer + "post_attention_layernorm.weight": torch.ones(hidden)}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # o_proj zero: attention adds nothing
        weights[f"{layer}self_attn.{name}.weight"] = torch.zeros(hidden, hidden)
    weights[layer + "mlp.gate_proj.weight"] = torch.zeros(intermediate, hidden)
    weights[layer + "mlp.up_proj.weight"] = torch.zeros(intermediate, hidden)
    weights[layer + "mlp.down_proj.weight"] = torch.zeros(hidden, intermediate)
    save_file(weights, str(folder / "model.safetensors"))


def decoded_prefix(pieces: list[bytes | str], count: int) -> str:
    """The text of the first `count` pieces as a stream decoder shows it: whole characters only."""
    data = b"".join(p.encode() if isinstance(p, str) else p for p in pieces[:count])
    return data.decode("utf-8", errors="ignore")
