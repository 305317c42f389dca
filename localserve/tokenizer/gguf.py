"""Rebuilding a `tokenizers.Tokenizer` from a GGUF file's metadata (byte-level BPE or SentencePiece BPE)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from localserve.tokenizer.errors import TokenizerError

log = logging.getLogger(__name__)

GGUF_SPECIAL_IDS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # GGUF token types (llama.cpp's llama_token_type)

# Pre-tokenizer split patterns of byte-level BPE vocabularies, by GGUF `tokenizer.ggml.pre`.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept inside words rather than split off as symbols.
QWEN35_SPLIT = QWEN2_SPLIT.replace(r"\p{L}+", r"[\p{L}\p{M}]+").replace(r"[^\s\p{L}\p{N}]", r"[^\s\p{L}\p{M}\p{N}]")
# o200k (gpt-4o, gpt-oss): case-aware words with their contractions, numbers in threes, "/" kept after symbols.
O200K_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + O200K_CONTRACTIONS
               + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + O200K_CONTRACTIONS
               + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx")
QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
QWEN35_PRE = ("qwen35",)
O200K_PRE = ("gpt-4o",)
SPLITS = {**dict.fromkeys(LLAMA3_PRE, LLAMA3_SPLIT), **dict.fromkeys(QWEN2_PRE, QWEN2_SPLIT),
          **dict.fromkeys(QWEN35_PRE, QWEN35_SPLIT), **dict.fromkeys(O200K_PRE, O200K_SPLIT)}
NFC_PRE = QWEN2_PRE + QWEN35_PRE  # their tokenizer.json normalize to NFC first
# tiktoken's vocabularies take a piece that is a whole token as it is, before any merge
WHOLE_PIECES_FIRST = LLAMA3_PRE + O200K_PRE
GPT2_PRE = ("default", "gpt2", "gpt-2")
GEMMA_END_OF_GENERATION = {"gemma3": ("<end_of_turn>",), "gemma4": ("<turn|>", "<|tool_response>")}



@dataclass
class GGUFTokenizerParts:
    """What `Tokenizer` is built from, read out of GGUF metadata."""

    backend: BackendTokenizer
    special_tokens: dict[str, str]
    eos_token_ids: list[int]
    chat_template: str | None
    source: str


def read_gguf_tokenizer(reader_or_path: Any) -> GGUFTokenizerParts:
    """The tokenizer of a GGUF file (a path or a `gguf.GGUFReader`); TokenizerError if it has none we know."""
    if hasattr(reader_or_path, "fields"):
        reader = reader_or_path
        name = str(getattr(getattr(reader, "data", None), "filename", None) or "<gguf>")
    else:
        import gguf

        name = str(reader_or_path)
        try:
            reader = gguf.GGUFReader(name)
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{name}: cannot read the GGUF file ({exc})") from None

    def meta(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    model, tokens = meta("tokenizer.ggml.model"), meta("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise TokenizerError(f"{name}: no tokenizer in the GGUF metadata (tokenizer.ggml.model/tokens)")
    types = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "gpt2":
        backend = _byte_level_bpe(tokens, types, meta("tokenizer.ggml.merges") or [],
                                  meta("tokenizer.ggml.pre", "default"))
    elif model == "llama":
        backend = _sentencepiece_bpe(tokens, meta("tokenizer.ggml.scores"),
                                     meta("tokenizer.ggml.unknown_token_id"),
                                     bool(meta("tokenizer.ggml.add_space_prefix", True)))
    elif model == "gemma4":
        backend = _merged_sentencepiece_bpe(tokens, meta("tokenizer.ggml.merges") or [],
                                            meta("tokenizer.ggml.unknown_token_id"))
    else:
        raise TokenizerError(f"{name}: unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model);"
                             " supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece) and 'gemma4' "
                             "(SentencePiece-style BPE with merges)")
    # CONTROL tokens are special; USER_DEFINED ones (like <think>) are matched whole but are plain text.
    kinds = dict(zip(tokens, types, strict=True))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in kinds.items() if kind in (UNKNOWN, CONTROL)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in kinds.items() if kind == USER_DEFINED])
    ids = {name: meta(f"tokenizer.ggml.{key}_token_id") for name, key in GGUF_SPECIAL_IDS.items()}
    special = {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}
    add_bos = meta("tokenizer.ggml.add_bos_token", model == "llama")  # llama.cpp's default
    _set_post_processor(backend, special.get("bos_token") if add_bos else None,
                        special.get("eos_token") if meta("tokenizer.ggml.add_eos_token", False) else None)
    # End of generation: EOS, and the end-of-turn / end-of-message tokens llama.cpp also stops at.
    eos_ids = [i for i in (ids["eos_token"], meta("tokenizer.ggml.eot_token_id"),
                           meta("tokenizer.ggml.eom_token_id")) if i is not None]
    # Gemma's end of a turn (and Gemma 4's hand-over after tool calls), which llama.cpp stops at by their text
    for text in GEMMA_END_OF_GENERATION.get(meta("general.architecture"), ()):
        if text in kinds and tokens.index(text) not in eos_ids:
            eos_ids.append(tokens.index(text))
    return GGUFTokenizerParts(backend, special, eos_ids, meta("tokenizer.chat_template"), name)


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str) -> BackendTokenizer:
    """Byte-level BPE (GPT-2 style) with the pre-tokenizer named by `tokenizer.ggml.pre`."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {}  # ordinary tokens are spelled in the byte alphabet; respell any that are not (a slip)
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        plain = kind in (CONTROL, USER_DEFINED) or set(token) <= alphabet
        vocab[token if plain else to_bytes.pre_tokenize_str(token)[0][0]] = i
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(BPE(vocab, pairs, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
                                   ignore_merges=pre in WHOLE_PIECES_FIRST))  # as Llama 3's tokenizer.json
    if pre == "smollm":  # SmolLM2's tokenizer.json: single digits, then GPT-2's byte-level regex
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif pre in SPLITS:
        split = SPLITS[pre]
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if pre in NFC_PRE:
            backend.normalizer = normalizers.NFC()
    else:
        if pre not in GPT2_PRE:
            log.warning("unknown GGUF pre-tokenizer %r; using GPT-2's byte-level regex", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, unk_id: int | None,
                       add_space_prefix: bool) -> BackendTokenizer:
    """SentencePiece BPE (Llama 2, Mistral) with byte fallback; merges recovered from the token scores."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    scores = scores if scores is not None else [-float(i) for i in range(len(tokens))]
    merges = []  # (left, right, score of the merged token), ordered as transformers' generate_merges
    for token, score in zip(tokens, scores, strict=True):
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk = tokens[unk_id] if unk_id is not None else None
    backend = BackendTokenizer(BPE(vocab, [(m[0], m[1]) for m in merges], unk_token=unk, fuse_unk=True,
                                   byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", split=False,
                                                     prepend_scheme="first" if add_space_prefix else "never")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    strip = [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(steps + strip)
    return backend


def _merged_sentencepiece_bpe(tokens: list[str], merges: list[str], unk_id: int | None) -> BackendTokenizer:
    """Gemma 4's BPE: spaces as `▁` (no space prefix, no pre-tokenizer), the file's merges, byte fallback."""
    unk = tokens[unk_id] if unk_id is not None else None
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(BPE({tok: i for i, tok in enumerate(tokens)}, pairs, unk_token=unk, fuse_unk=True,
                                   byte_fallback=True, dropout=None))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    """Make `encode(..., add_special_tokens=True)` add BOS and/or EOS, as the GGUF metadata asks."""
    tokens = [token for token in (bos, eos) if token]
    if tokens:
        single = " ".join([*([bos] if bos else []), "$A", *([eos] if eos else [])])
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B:1')}",
            special_tokens=[(token, backend.token_to_id(token)) for token in dict.fromkeys(tokens)])
