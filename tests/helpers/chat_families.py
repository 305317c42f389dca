"""The chat-template families the formats are tested on: each family's real template and its vocabulary.

Templates and vocabularies come from llama.cpp (`llama_cpp_files`). A vocabulary GGUF there is a base model's
(Qwen2's, Llama 3's, Llama 2's SentencePiece one), whose placeholder ids ([PAD151646] ... in Qwen2,
<|reserved_special_token_N|> in Llama 3) the instruct models name. Each family's tokenizer is rebuilt with
localserve's GGUF rebuilding (`Tokenizer.from_gguf`) from that file's metadata with the family's names put on
those ids, as the family's tokenizer.json does (the merges and ordinary tokens are the same), and its kind:
special (control) or an ordinary added token. Where llama.cpp ships no vocabulary of the family (Mistral's
Tekken), the closest one is used with the family's control tokens added; `vocabulary_note` says which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache

import gguf

from localserve.tokenizer.tokenizer import Tokenizer
from tests.helpers.llama_cpp_files import template_text, vocabulary_path

CONTROL, USER_DEFINED, NORMAL = 3, 4, 1  # GGUF token types

QWEN25_TOKENS = {  # Qwen2.5's tokenizer_config.json added_tokens_decoder beyond Qwen2's three
    151646: ("<|object_ref_start|>", True), 151647: ("<|object_ref_end|>", True), 151648: ("<|box_start|>", True),
    151649: ("<|box_end|>", True), 151650: ("<|quad_start|>", True), 151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True), 151653: ("<|vision_end|>", True), 151654: ("<|vision_pad|>", True),
    151655: ("<|image_pad|>", True), 151656: ("<|video_pad|>", True), 151657: ("<tool_call>", False),
    151658: ("</tool_call>", False), 151659: ("<|fim_prefix|>", False), 151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False), 151662: ("<|fim_pad|>", False), 151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False),
}
QWEN3_TOKENS = QWEN25_TOKENS | {151665: ("<tool_response>", False), 151666: ("</tool_response>", False),
                                151667: ("<think>", False), 151668: ("</think>", False)}
R1_DISTILL_QWEN_TOKENS = QWEN25_TOKENS | {  # DeepSeek-R1-Distill-Qwen's tokenizer_config.json
    151643: ("<｜end▁of▁sentence｜>", True), 151644: ("<｜User｜>", False), 151645: ("<｜Assistant｜>", False),
    151646: ("<｜begin▁of▁sentence｜>", True), 151647: ("<|EOT|>", False), 151648: ("<think>", False),
    151649: ("</think>", False),
}
LLAMA31_TOKENS = {128004: ("<|finetune_right_pad_id|>", True), 128008: ("<|eom_id|>", True),
                  128010: ("<|python_tag|>", True)}
HERMES3_TOKENS = LLAMA31_TOKENS | {128002: ("<|im_start|>", True), 128003: ("<|im_end|>", True)}
MISTRAL_CONTROL = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]", "[TOOL_CALLS]")
MISTRAL_SMALL_TOKENS = {128000: ("<s>", True), 128001: ("</s>", True)} | {
    128011 + offset: (text, True) for offset, text in enumerate(
        (*MISTRAL_CONTROL, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]", "[IMG]"))}


@dataclass(frozen=True)
class Family:
    """One family: its template and vocabulary files, the names put on ids, and what detection should find."""

    template: str
    vocabulary: str
    named_tokens: dict[int, tuple[str, bool]]
    eos: tuple[str, ...]
    tool_format: str
    reasoning: str | None = None
    appended_control: tuple[str, ...] = ()  # control tokens the closest vocabulary lacks, added at its end
    vocabulary_note: str = ""
    template_variables: dict = field(default_factory=dict)


FAMILIES = {
    "qwen2.5": Family("Qwen-Qwen2.5-7B-Instruct.jinja", "ggml-vocab-qwen2.gguf", QWEN25_TOKENS, ("<|im_end|>",),
                      "hermes"),
    "qwen3": Family("Qwen-Qwen3-0.6B.jinja", "ggml-vocab-qwen2.gguf", QWEN3_TOKENS, ("<|im_end|>",), "hermes",
                    "think"),
    "qwen3-coder": Family("Qwen3-Coder.jinja", "ggml-vocab-qwen2.gguf", QWEN3_TOKENS, ("<|im_end|>",),
                          "qwen3_coder"),
    "qwq": Family("Qwen-QwQ-32B.jinja", "ggml-vocab-qwen2.gguf", QWEN3_TOKENS, ("<|im_end|>",), "hermes", "think"),
    "llama3.1": Family("meta-llama-Llama-3.1-8B-Instruct.jinja", "ggml-vocab-llama-bpe.gguf", LLAMA31_TOKENS,
                       ("<|eot_id|>", "<|eom_id|>"), "llama3_json"),
    "llama3.2": Family("meta-llama-Llama-3.2-3B-Instruct.jinja", "ggml-vocab-llama-bpe.gguf", LLAMA31_TOKENS,
                       ("<|eot_id|>", "<|eom_id|>"), "llama3_json"),
    "llama3.3": Family("meta-llama-Llama-3.3-70B-Instruct.jinja", "ggml-vocab-llama-bpe.gguf", LLAMA31_TOKENS,
                       ("<|eot_id|>", "<|eom_id|>"), "llama3_json"),
    "hermes3": Family("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "ggml-vocab-llama-bpe.gguf",
                      HERMES3_TOKENS, ("<|im_end|>",), "hermes",
                      vocabulary_note="Llama 3.1's; <|im_start|>/<|im_end|> put on reserved ids 128002/128003"),
    "mistral-nemo": Family("mistralai-Mistral-Nemo-Instruct-2407.jinja", "ggml-vocab-llama-spm.gguf", {},
                           ("</s>",), "mistral_array", appended_control=MISTRAL_CONTROL,
                           vocabulary_note="Tekken is not in the sdist: Llama 2's SentencePiece vocabulary (the kind "
                                           "of Mistral 7B v0.3's, which writes calls the same way) with Mistral's "
                                           "control tokens added at its end"),
    "mistral-small-3.2": Family("Mistral-Small-3.2-24B-Instruct-2506.jinja", "ggml-vocab-llama-bpe.gguf",
                                MISTRAL_SMALL_TOKENS, ("</s>",), "mistral_args",
                                vocabulary_note="Tekken is not in the sdist: Llama 3's byte-level BPE (Tekken's kind) "
                                                "with Mistral's control tokens on reserved ids"),
    "qwen3.5": Family("Qwen3.5-4B.jinja", "ggml-vocab-qwen35.gguf", QWEN3_TOKENS, ("<|im_end|>",), "qwen3_coder",
                      "think", vocabulary_note="llama.cpp's qwen35 vocabulary is Qwen2's 151,936 tokens with Qwen3.5's "
                                               "pre-tokenizer; Qwen3.5's own names the same tokens in the same order "
                                               "from id 248044, here put on the placeholders as for Qwen3"),
    "deepseek-r1-distill-qwen": Family("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "ggml-vocab-qwen2.gguf",
                                       R1_DISTILL_QWEN_TOKENS, ("<｜end▁of▁sentence｜>",), "json", "think"),
}


class _Field:
    """A GGUF metadata field as `read_gguf_tokenizer` reads one."""

    def __init__(self, value: object) -> None:
        self._value = value

    def contents(self) -> object:
        return self._value


class _GGUFView:
    """A GGUF reader's metadata with some fields replaced."""

    def __init__(self, path: str, fields: dict[str, object]) -> None:
        self.fields = fields
        self.data = type("Data", (), {"filename": path})()


@cache
def tokenizer_metadata(vocabulary: str) -> dict[str, object]:
    """The `tokenizer.*` metadata of a vocabulary GGUF, read once per machine: the gguf package takes half a
    minute to parse Qwen2's 150,000 tokens and merges, so the values are kept beside the file as JSON."""
    path = vocabulary_path(vocabulary)
    kept = path.with_name(path.name + ".tokenizer.json")
    if kept.is_file():
        return json.loads(kept.read_text(encoding="utf-8"))
    reader = gguf.GGUFReader(str(path))
    metadata = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    partial = kept.with_suffix(".partial")
    partial.write_text(json.dumps(metadata, ensure_ascii=False), encoding="utf-8")
    partial.replace(kept)
    return metadata


@cache
def family_tokenizer(name: str) -> Tokenizer:
    """The family's tokenizer: its vocabulary's GGUF metadata with the family's tokens named, and its template."""
    family = FAMILIES[name]
    path = vocabulary_path(family.vocabulary)
    fields = {key: _Field(value) for key, value in tokenizer_metadata(family.vocabulary).items()}
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    for token_id, (text, special) in family.named_tokens.items():
        tokens[token_id], types[token_id] = text, CONTROL if special else USER_DEFINED
    if family.appended_control:
        tokens += family.appended_control
        types += [CONTROL] * len(family.appended_control)
        if "tokenizer.ggml.scores" in fields:
            fields["tokenizer.ggml.scores"] = _Field(
                list(fields["tokenizer.ggml.scores"].contents()) + [0.0] * len(family.appended_control))
    fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"] = _Field(tokens), _Field(types)
    ids = {text: index for index, text in enumerate(tokens)}
    eos = [ids[text] for text in family.eos]
    fields["tokenizer.ggml.eos_token_id"] = _Field(eos[0])
    fields.pop("tokenizer.ggml.eot_token_id", None)
    fields.pop("tokenizer.ggml.eom_token_id", None)
    if len(eos) > 1:
        fields["tokenizer.ggml.eom_token_id"] = _Field(eos[1])
    if "<｜begin▁of▁sentence｜>" in ids:
        fields["tokenizer.ggml.bos_token_id"] = _Field(ids["<｜begin▁of▁sentence｜>"])
    fields["tokenizer.chat_template"] = _Field(template_text(family.template))
    return Tokenizer.from_gguf(_GGUFView(str(path), fields))


@cache
def reference_tokenizer(name: str):
    """transformers' tokenizer over the same vocabulary and template, to render with as the reference."""
    from tests.helpers.tokenizers import reference_for

    ours = family_tokenizer(name)
    return reference_for(ours.backend, ours.chat_template, **ours.special_tokens_map)
