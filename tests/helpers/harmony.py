"""gpt-oss's harmony format in the tests: llama.cpp's real template, and a tokenizer with harmony's real tokens.

gpt-oss's vocabulary is o200k_harmony (201,088 ids), which llama.cpp's sdist does not ship. The tokenizer here
is Llama 3's byte-level BPE vocabulary (the sdist's `ggml-vocab-llama-bpe.gguf`, of the same tiktoken lineage)
grown to o200k_harmony's size, with harmony's special tokens on their real ids (the public o200k_harmony
spec: `<|startoftext|>` 199998 ... `<|call|>` 200012, `<|endofprompt|>` 200018, the rest of 199998-201087
`<|reserved_N|>`) and o200k's pre-tokenizer (`tokenizer.ggml.pre` "gpt-4o"), rebuilt by localserve's GGUF
rebuilding as a gpt-oss GGUF would be. Llama 3's own special
ids and the ids between its vocabulary and 199998 are placeholders no text encodes to. End of sequence is
`<|return|>` alone, as a gpt-oss GGUF names it: `<|call|>` ends a turn as the format's stop token.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from localserve.tokenizer.tokenizer import Tokenizer
from tests.helpers.chat_families import CONTROL, NORMAL, _Field, _GGUFView, tokenizer_metadata
from tests.helpers.llama_cpp_files import template_text, vocabulary_path

HARMONY_TEMPLATE = "openai-gpt-oss-120b.jinja"
BASE_VOCABULARY = "ggml-vocab-llama-bpe.gguf"
VOCAB_SIZE = 201088  # o200k_harmony, GptOssConfig's default vocab_size
FIRST_SPECIAL = 199998
HARMONY_TOKENS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                  200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
                  200008: "<|message|>", 200012: "<|call|>", 200018: "<|endofprompt|>"}
RETURN_ID, CALL_ID = 200002, 200012


@cache
def harmony_tokenizer() -> Tokenizer:
    """The harmony tokenizer with llama.cpp's gpt-oss template."""
    metadata = tokenizer_metadata(BASE_VOCABULARY)
    base = list(metadata["tokenizer.ggml.tokens"])
    base_types = list(metadata["tokenizer.ggml.token_type"])
    tokens, types = [], []
    for index in range(VOCAB_SIZE):
        if index >= FIRST_SPECIAL:
            tokens.append(HARMONY_TOKENS.get(index, f"<|reserved_{index}|>"))
            types.append(CONTROL)
        elif index < len(base) and base_types[index] == NORMAL:
            tokens.append(base[index])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{index}]")
            types.append(NORMAL)
    fields = {key: _Field(value) for key, value in metadata.items()}
    fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"] = _Field(tokens), _Field(types)
    fields["tokenizer.ggml.bos_token_id"] = _Field(199998)
    fields["tokenizer.ggml.eos_token_id"] = _Field(RETURN_ID)
    fields["tokenizer.ggml.padding_token_id"] = _Field(199999)
    fields["tokenizer.ggml.add_bos_token"] = _Field(False)
    fields["tokenizer.ggml.pre"] = _Field("gpt-4o")  # o200k's pre-tokenizer, as a gpt-oss GGUF names it
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.unknown_token_id"):
        fields.pop(key, None)
    fields["tokenizer.chat_template"] = _Field(template_text(HARMONY_TEMPLATE))
    return Tokenizer.from_gguf(_GGUFView(str(vocabulary_path(BASE_VOCABULARY)), fields))


@cache
def harmony_reference():
    """transformers' tokenizer over the same vocabulary and template, to render with as the reference."""
    from tests.helpers.tokenizers import reference_for

    ours = harmony_tokenizer()
    return reference_for(ours.backend, ours.chat_template, **ours.special_tokens_map)


# ------------------------------------------------------------------ a scripted model that speaks harmony
SCRIPT_HIDDEN = 32
SCRIPT_LOGIT = 32.0
# What the scripted model says after the prompt's `<|start|>assistant` when its call is forced: an analysis
# message, then (the grammar steering it once the script would repeat itself) the call with `city` "Paris".
SCRIPT_REASONING = "I should look."
SCRIPT_CITY = "Paris"


def write_harmony_model(folder: Path) -> Path:
    """A tiny gpt-oss folder with the harmony tokenizer and template whose greedy next token depends only on the
    last one (tests/helpers/scripted.py's idea, on a 201,088-id vocabulary):
    after `assistant` it opens a channel, names it `analysis`, says SCRIPT_REASONING and ends the message; then
    back at `assistant` it would say the same again, which a forced call's grammar (one analysis at most) does
    not allow: the allowed token with the lowest id wins among the rest (all logits 0), so the grammar writes
    the call's header; in the arguments' free string SCRIPT_CITY is preferred (a small bias on every token),
    then the string and the object close. Without a grammar it repeats its analysis until its token limit."""
    tokenizer = harmony_tokenizer()

    def token(text: str) -> int:
        [token_id] = tokenizer.encode(text, add_special_tokens=False)
        return token_id

    steps = ["assistant", "<|channel|>", "analysis", "<|message|>", "I", " should", " look", ".", "<|end|>",
             "<|start|>", "assistant"]
    successor = {token(a): token(b) for a, b in zip(steps, steps[1:])}
    successor[token(SCRIPT_CITY)] = token('"}')  # the string and the object close
    states = {token_id: index for index, token_id in enumerate(sorted({*successor, *successor.values()}))}
    constant = SCRIPT_HIDDEN - 1
    assert len(states) < constant
    scale = (SCRIPT_HIDDEN / 2) ** 0.5  # RMSNorm of a row with two ones
    embedding = torch.zeros(VOCAB_SIZE, SCRIPT_HIDDEN)
    embedding[:, constant] = 1.0
    head = torch.zeros(VOCAB_SIZE, SCRIPT_HIDDEN)
    for token_id, state in states.items():
        embedding[token_id, state] = 1.0
    for token_id, following in successor.items():
        head[following, states[token_id]] = SCRIPT_LOGIT / scale
    head[token(SCRIPT_CITY), constant] = 8.0 / scale
    write_scripted_gpt_oss(folder, embedding, head)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
         "chat_template": tokenizer.chat_template}))
    return folder


def write_scripted_gpt_oss(folder: Path, embedding: torch.Tensor, head: torch.Tensor) -> None:
    """A tiny gpt-oss (transformers' GptOssConfig: windows, sinks, experts) whose layers add nothing (every
    weight and bias zero but the norms'): its logits are `head @ rmsnorm(embedding[token])`."""
    import transformers

    from tests.helpers.gpt_oss_models import tiny_config

    vocab, hidden = embedding.shape
    config = tiny_config(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
                         num_experts_per_tok=1, bos_token_id=FIRST_SPECIAL, eos_token_id=RETURN_ID,
                         pad_token_id=FIRST_SPECIAL + 1, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        model.get_input_embeddings().weight.copy_(embedding)
        model.get_output_embeddings().weight.copy_(head)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
