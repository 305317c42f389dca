"""Constrained decoding, the engine's side: requests' grammars compiled for one model's tokenizer, and
one llguidance matcher per sequence.

`GrammarCompiler` builds llguidance's tokenizer from the model's `tokenizers` JSON once (on the first
constrained request; a tokenizer rebuilt from GGUF metadata serves as well), compiles a request's
`GrammarSpec` with the request's reasoning marker around it (see `compose_grammar`), and keeps the
compiled matchers of recent grammars: a request is validated (compiled, or refused with a ValueError
naming why) before it is added, and each sequence then starts from a copy of the compiled matcher.

A `SequenceGrammar` is a sequence's matcher: it sees every token the sequence samples (`advance`),
says when the grammar is complete, and is copied for parallel samples (`fork`). It is part of the
sequence's state: a preemption, by recompute or by swap, changes nothing in it (the tokens it has
seen are the sequence's output, which a recompute prefills again). Masks are engine/grammar_masks.py's.

No torch here.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from tokenizers import Tokenizer as BackendTokenizer

    from localserve.engine.grammar import GrammarSpec
    from localserve.engine.sampling_params import SamplingParams

BODY = "ls_body"  # the name the composed grammar gives a body grammar that has none
_EXCERPT = re.compile(r"^\s*(\d+ \|.*|\^+)\s*$")  # a numbered line of the grammar, or a caret under it
MAX_GAP = 4  # whitespace characters allowed between the reasoning block's end and the grammar


class GrammarError(ValueError):
    """A request's grammar cannot run on this model: it does not compile, or the model's tokenizer cannot
    be read for grammars (the request is refused before it is added)."""


class GrammarRejected(RuntimeError):
    """A sampled token the grammar does not allow: only a token that was not masked can be one."""


@dataclass(eq=False, slots=True)
class SequenceGrammar:
    """One sequence's matcher."""

    matcher: LLMatcher

    def advance(self, token_id: int) -> bool:
        """Consume the sequence's next token; True once the grammar is complete (nothing may follow).
        Raises GrammarRejected for a token the grammar does not allow."""
        matcher = self.matcher
        if not matcher.consume_token(token_id):
            raise GrammarRejected(f"the grammar rejected token {token_id}: {matcher.get_error()}")
        return matcher.is_stopped()

    def num_allowed(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order from the matcher's state, the grammar allows (nothing consumed)."""
        return self.matcher.validate_tokens(token_ids)

    def fork(self) -> SequenceGrammar:
        """An independent copy in the same state (a parallel sample forked from this sequence)."""
        return SequenceGrammar(self.matcher.deep_copy())


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What composing a grammar needs to know of the tokenizer: its added tokens (one token each to
    llguidance, never spelled by text) and its end-of-sequence ids."""

    tokenizer: LLTokenizer
    special_ids: frozenset[int]
    eos_ids: frozenset[int]

    def single_token(self, text: str) -> int | None:
        """The id of the added token that is exactly `text`, if there is one."""
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        return ids[0] if len(ids) == 1 and ids[0] in self.special_ids else None


class GrammarCompiler:
    """Compiles requests' grammars against one model's tokenizer (thread-safe: the server validates a
    request on its own thread while the engine thread adds others)."""

    def __init__(self, tokenizer: BackendTokenizer | None, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = 64) -> None:
        """`vocab_size` is the model's (the width of its logits, at least the tokenizer's)."""
        self._backend = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = sorted(set(eos_token_ids))
        self._cache_size = cache_size
        self._compiled: OrderedDict[tuple[str, str | None, str | None], LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._vocabulary: Vocabulary | None = None

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError, naming why, if the request's grammar cannot run on this model."""
        if params.grammar is not None:
            self._compile(params.grammar, params.reasoning_end)

    def matcher(self, params: SamplingParams) -> SequenceGrammar | None:
        """A fresh matcher for a sequence of a request (None without a grammar)."""
        if params.grammar is None:
            return None
        return SequenceGrammar(self._compile(params.grammar, params.reasoning_end).deep_copy())

    @property
    def vocabulary(self) -> Vocabulary:
        """llguidance's tokenizer for this model, built on first use (about a second for a 150k vocabulary)."""
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = self._build_vocabulary()
            return self._vocabulary

    def _build_vocabulary(self) -> Vocabulary:
        import llguidance

        if self._backend is None:
            raise GrammarError("a grammar needs the model's tokenizer, and this engine has none")
        size = self._backend.get_vocab_size(with_added_tokens=True)
        if size > self.vocab_size:
            raise GrammarError(f"the tokenizer has {size} ids but the model's vocabulary only {self.vocab_size}: "
                               f"grammars cannot be applied to this model")
        try:
            tokenizer = llguidance.LLTokenizer(self._backend.to_str(), n_vocab=self.vocab_size,
                                               eos_token=self._eos_ids or None)
        except ValueError as exc:  # a tokenizer llguidance cannot read (say, one with no decoder)
            raise GrammarError(f"grammars cannot be applied to this model: llguidance cannot read its tokenizer "
                               f"({exc})") from None
        added = self._backend.get_added_tokens_decoder()
        special = frozenset(i for i in added if tokenizer.is_special_token(i))
        return Vocabulary(tokenizer, special, frozenset(tokenizer.eos_tokens))

    def _compile(self, spec: GrammarSpec, reasoning_end: str | None) -> LLMatcher:
        import llguidance

        key = (spec.grammar, spec.trigger, reasoning_end)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        vocabulary = self.vocabulary
        grammar = compose_grammar(spec, reasoning_end, vocabulary)
        matcher = llguidance.LLMatcher(vocabulary.tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind} grammar does not compile: {_error_text(matcher.get_error())}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return matcher


def compose_grammar(spec: GrammarSpec, reasoning_end: str | None, vocabulary: Vocabulary) -> str:
    """The grammar the matcher runs: the spec's own, after the reasoning block and the lazy trigger.

    With neither it is the spec's grammar as given. Otherwise a Lark grammar comes first and refers
    to the spec's (its first grammar, by name) where that starts: after `reasoning_end` (and up to
    MAX_GAP whitespace characters), and, for a lazy spec, after the trigger, or never (the output
    may end as free text). Free text is any text plus any added token but the end-of-sequence ones;
    inside the reasoning block the end of sequence is not allowed (the grammar has not been met).
    """
    if spec.trigger is None and reasoning_end is None:
        return spec.grammar
    try:
        body = json.loads(spec.grammar)
        grammars = [dict(grammar) for grammar in body["grammars"]]
    except (ValueError, KeyError, TypeError):
        raise GrammarError(f"the {spec.kind} grammar is not llguidance's JSON (an object with a \"grammars\" "
                         f"list)") from None
    if not grammars:
        raise GrammarError(f"the {spec.kind} grammar has no grammars")
    name = grammars[0].setdefault("name", BODY)
    rules: list[str] = []
    answer = f"@{name}"
    if spec.trigger is not None:
        rules += _free_until("ls_call", spec.trigger, vocabulary)
        answer = f"ls_call_free | ls_call @{name}"
    if reasoning_end is not None:
        rules += _free_until("ls_reasoning", reasoning_end, vocabulary)
        gap = "" if spec.trigger is not None else " ls_gap"
        if gap:
            rules.append(f"ls_gap: /[ \\t\\r\\n]{{0,{MAX_GAP}}}/")
        rules.insert(0, f"start: ls_reasoning{gap} ls_tail\nls_tail: {answer}")
    else:
        rules.insert(0, f"start: {answer}")
    wrapper = {"name": "ls_start", "lark_grammar": "\n".join(rules) + "\n"}
    return json.dumps({**body, "grammars": [wrapper, *grammars]})


def _free_text(name: str, marker: str, vocabulary: Vocabulary) -> list[str]:
    """Rules for `name`: text without `marker`, with any added token but the end-of-sequence ones and
    the marker's own."""
    token = vocabulary.single_token(marker)
    others = _token_set(vocabulary.special_ids - vocabulary.eos_ids - {token})
    text = f"{name.upper()}_TEXT"
    return [f"{name}: ({text}{' | ' + others if others else ''})*",
            f"{text}: /(?s:.+)/ & ~/(?s:.*{_regex_literal(marker)}.*)/"]


def _free_until(name: str, marker: str, vocabulary: Vocabulary) -> list[str]:
    """Rules for `name`: free text up to and including the first `marker`, as text or as its token."""
    token = vocabulary.single_token(marker)
    ends = [f"{name}_last"] + ([f"<[{token}]>"] if token is not None else [])
    return [f"{name}: {name}_free ({' | '.join(ends)})",
            *_free_text(f"{name}_free", marker, vocabulary),
            f"{name}_last[suffix={json.dumps(marker, ensure_ascii=False)}]: /(?s:.*)/"]


def _token_set(ids: Iterable[int]) -> str:
    """llguidance's Lark for "one of these tokens", runs of ids as ranges: <[3,7-9]>; '' for none."""
    runs: list[list[int]] = []
    for token in sorted(ids):
        if runs and token == runs[-1][1] + 1:
            runs[-1][1] = token
        else:
            runs.append([token, token])
    if not runs:
        return ""
    return "<[" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "]>"


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches it literally, safe between Lark's slashes: every ASCII character
    but letters and digits as a hex escape (Rust's regex gives some escaped punctuation a meaning)."""
    return "".join(c if c.isalnum() or ord(c) > 127 else f"\\x{{{ord(c):02x}}}" for c in text)


def _error_text(error: str) -> str:
    """llguidance's error on one line: without its excerpts of the grammar (numbered lines and carets,
    which show the grammar as llguidance rewrote it, not as the client wrote it) and its debug marker."""
    lines = error.replace("<non-verbose/>", "").splitlines()
    kept = [line.strip() for line in lines if line.strip() and not _EXCERPT.match(line)]
    return " ".join(kept)
