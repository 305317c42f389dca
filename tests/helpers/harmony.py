"""gpt-oss's harmony format in the tests: llama.cpp's real template, and a tokenizer with harmony's real tokens.

gpt-oss's vocabulary is o200k_harmony (201,088 ids), which llama.cpp's sdist does not ship. The tokenizer here
is Llama 3's byte-level BPE vocabulary (the sdist's `ggml-vocab-llama-bpe.gguf`, of the same tiktoken lineage)
grown to o200k_harmony's size, with harmony's special tokens on their real ids (the public o200k_harmony
spec: `<|startoftext|>` 199998 ... `<|call|>` 200012, `<|endofprompt|>` 200018, the rest of 199998-201087
`<|reserved_N|>`), rebuilt by localserve's GGUF rebuilding as a gpt-oss GGUF would be. Llama 3's own special
ids and the ids between its vocabulary and 199998 are placeholders no text encodes to. End of sequence is
`<|return|>` alone, as a gpt-oss GGUF names it: `<|call|>` ends a turn as the format's stop token.
"""

from __future__ import annotations

from functools import cache

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
