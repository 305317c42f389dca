"""The tokenizer: the `tokenizers` library, the model's special tokens and its chat template.

Two sources: a Hugging Face folder (`tokenizer.json`, `tokenizer_config.json`, optionally
`chat_template.jinja`, `generation_config.json`, `config.json`), or the metadata of a GGUF file, from
which an equivalent `tokenizers.Tokenizer` is rebuilt (byte-level BPE or SentencePiece-style BPE).

Text that a user types which spells a special token (say "<|im_end|>" inside a message) stays plain
text in `encode_chat`: only the special tokens the chat template itself writes become special ids.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from localserve.tokenizer.chat_template import render_chat_template
from localserve.tokenizer.errors import TokenizerError
from localserve.tokenizer.gguf import read_gguf_tokenizer

__all__ = ["StreamDecoder", "Tokenizer", "TokenizerError"]

log = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
class StreamDecoder:
    """Incremental detokenizer for one sequence: feed ids one at a time, get text safe to show.

    Built on `tokenizers.decoders.DecodeStream`: a character whose bytes are spread over several
    tokens comes out whole once complete, and the chunks concatenate to `decode(all_ids)`.
    """

    def __init__(self, backend: BackendTokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self.skip_special_tokens = skip_special_tokens
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one token id; return the new text it completes ('' when none is complete yet)."""
        return self._stream.step(self._backend, int(token_id)) or ""


class Tokenizer:
    """Encode, decode, stream-decode and apply the chat template of one model."""

    def __init__(self, backend: BackendTokenizer, *, special_tokens: Mapping[str, str | None],
                 eos_token_ids: Sequence[int] | None = None, chat_template: str | None = None,
                 source: str = "<memory>") -> None:
        self.backend = backend
        self.source = source  # the file or folder it came from, for error messages
        self.chat_template = chat_template
        self.special_tokens_map = {name: text for name, text in special_tokens.items() if text}
        bos, eos = self.special_tokens_map.get("bos_token"), self.special_tokens_map.get("eos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos else None
        if eos_token_ids is None:
            eos_token_ids = [i for i in [backend.token_to_id(eos) if eos else None] if i is not None]
        self.eos_token_ids: list[int] = list(dict.fromkeys(int(i) for i in eos_token_ids))
        added = backend.get_added_tokens_decoder().values()
        self._special_added = {token.content: token for token in added if token.special}
        longest_first = sorted(self._special_added, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        self._plain_backend: BackendTokenizer | None = None  # special-token matching off; see _encode_plain
        self._plain_lock = threading.Lock()
        first = backend.encode("a", add_special_tokens=False).tokens
        self._prepends_space = bool(first) and first[0].startswith("▁")  # SentencePiece style

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """A `.gguf` file or a Hugging Face folder."""
        path = Path(path)
        return cls.from_gguf(path) if path.suffix == ".gguf" else cls.from_hf_folder(path)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and its companions from a Hugging Face model folder."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file}: file not found (a model folder needs tokenizer.json)")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{tokenizer_file}: not a valid tokenizer.json ({exc})") from None
        config = {**_read_json(folder / "special_tokens_map.json"),
                  **_read_json(folder / "tokenizer_config.json")}
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {entry.get("name"): entry.get("template") for entry in template}.get("default")
        if (folder / "chat_template.jinja").is_file():  # as in transformers, the file wins
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        eos_ids = None
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(folder / name).get("eos_token_id")
            if eos is not None:
                eos_ids = [eos] if isinstance(eos, int) else list(eos)
                break
        return cls(backend, special_tokens=special, eos_token_ids=eos_ids, chat_template=template,
                   source=str(folder))

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> Tokenizer:
        """Rebuild the tokenizer described by a GGUF file's metadata (a path or a `gguf.GGUFReader`)."""
        parts = read_gguf_tokenizer(reader_or_path)
        return cls(parts.backend, special_tokens=parts.special_tokens, eos_token_ids=parts.eos_token_ids,
                   chat_template=parts.chat_template, source=parts.source)

    # ---------------------------------------------------------------- encoding and decoding
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-generation id (`eos_token_ids` holds all of them)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def added_tokens(self) -> dict[str, tuple[int, bool]]:
        """Each added token by its text: its id and whether it is special (a decoder that skips special tokens
        leaves its text out; ordinary added tokens, like Qwen's `<tool_call>`, are matched whole but are text)."""
        decoder = self.backend.get_added_tokens_decoder()
        return {token.content: (token_id, token.special) for token_id, token in sorted(decoder.items())}

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string (None if it is not in the vocabulary)."""
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a leading BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary are skipped."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental detokenizer for one sequence."""
        return StreamDecoder(self.backend, skip_special_tokens)

    # ---------------------------------------------------------------- chat
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages`, rendered as transformers renders it."""
        template = kwargs.pop("chat_template", None) or self.chat_template
        if not template:
            raise TokenizerError(f"{self.source}: the tokenizer has no chat template")
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, special_tokens=self.special_tokens_map, **kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, *,
                    expand: Callable[[str], str] | None = None, **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat; special tokens typed in the inputs stay plain text.

        Without such text this is `encode(apply_chat_template(...), add_special_tokens=False)`, exactly
        as transformers tokenizes a chat. Otherwise each typed occurrence becomes a private-use
        placeholder while rendering, so the special tokens in the rendered text are the template's own;
        the text between them is encoded with special-token matching off and the placeholders restored.
        `expand` (the images' text: server/generation/image_prompt.py) is applied to the rendered text before
        it is tokenized; it sees only the template's own special tokens (typed ones are placeholders then).
        """
        expand = expand or _unchanged
        template = kwargs.pop("chat_template", None) or self.chat_template
        inputs = [list(messages), tools, kwargs]
        strings = _strings(inputs)
        if self._special_re is None or not any(self._special_re.search(s) for s in strings):
            text = self.apply_chat_template(messages, add_generation_prompt, tools, chat_template=template,
                                            **kwargs)
            return self.encode(expand(text), add_special_tokens=False)
        used = set("".join(strings)) | set(template or "")
        free = (chr(c) for c in range(0xF0000, 0xFFFFE) if chr(c) not in used)  # supplementary private use
        placeholders = {token: next(free) for token in self._special_added}
        restore = str.maketrans({char: token for token, char in placeholders.items()})
        marked = _map_strings(inputs, lambda s: self._special_re.sub(lambda m: placeholders[m.group()], s))
        rendered = expand(self.apply_chat_template(marked[0], add_generation_prompt, marked[1],
                                                   chat_template=template, **marked[2]))
        pieces = re.split(f"({self._special_re.pattern})", rendered)  # text, special, text, special, ...
        ids: list[int] = []
        for index, piece in enumerate(pieces):
            if index % 2:
                ids.append(self.backend.token_to_id(piece))
                continue
            if index and self._special_added[pieces[index - 1]].rstrip:  # as the added token would strip
                piece = piece.lstrip()
            if index + 1 < len(pieces) and self._special_added[pieces[index + 1]].lstrip:
                piece = piece.rstrip()
            if piece:
                ids += self._encode_plain(piece.translate(restore), mid_sequence=index > 0)
        return ids

    def _encode_plain(self, text: str, mid_sequence: bool) -> list[int]:
        """Encode `text` with special-token strings as ordinary text, on a second backend (thread safe)."""
        with self._plain_lock:
            if self._plain_backend is None:
                self._plain_backend = BackendTokenizer.from_str(self.backend.to_str())
                self._plain_backend.encode_special_tokens = True
        encode = self._plain_backend.encode
        if mid_sequence and self._prepends_space:
            # SentencePiece-style tokenizers add a "▁" at the start of a string but not after an added
            # token: encode after a newline, then drop the newline (transformers' trick).
            newline = encode("\n", add_special_tokens=False).ids
            ids = encode("\n" + text, add_special_tokens=False).ids
            if ids[:len(newline)] == newline:
                return ids[len(newline):]
        return encode(text, add_special_tokens=False).ids


# -------------------------------------------------------------------- helpers
def _unchanged(text: str) -> str:
    return text


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _map_strings(obj: Any, function: Callable[[str], str]) -> Any:
    """A copy of nested lists, tuples and dicts with `function` applied to every string value."""
    if isinstance(obj, str):
        return function(obj)
    if isinstance(obj, Mapping):
        return {key: _map_strings(value, function) for key, value in obj.items()}
    return [_map_strings(value, function) for value in obj] if isinstance(obj, (list, tuple)) else obj


def _strings(obj: Any) -> list[str]:
    """Every string inside nested lists, tuples and dict values."""
    found: list[str] = []
    _map_strings(obj, lambda text: found.append(text) or text)
    return found
