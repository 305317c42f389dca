"""What a request's output must match: a grammar as plain data, carried by `SamplingParams.grammar`.

A `GrammarSpec` holds the grammar as llguidance takes it (its top-level grammar, as JSON text) and
nothing compiled: the engine compiles it against the model's tokenizer when the request is validated
(engine/constraints.py), and a grammar that does not compile is refused there with a ValueError that
names why. The constructors build the grammar from what a client or a chat format gives:

- `GrammarSpec.json_schema(schema, strict=True)`: a JSON value matching the schema, written with
  `", "` and `": "` between items and no other whitespace; `strict` refuses a schema keyword
  llguidance cannot enforce (strict=False ignores it instead);
- `GrammarSpec.json_object()`: any JSON object (`response_format: json_object`);
- `GrammarSpec.regex(pattern)`: text the whole of which matches the regex (Rust `regex` syntax);
- `GrammarSpec.lark(text)`: a grammar in llguidance's Lark syntax (`%json {...}` embeds a schema,
  `<name>` or `<[id]>` is a token: an added token of the vocabulary, special or not, such as Qwen's
  `<tool_call>`, is one token to llguidance, and the quoted string "<tool_call>" spells it out of
  ordinary tokens instead);
- `GrammarSpec.gbnf(text)`: llama.cpp's GBNF (the `grammar` field), through llguidance's converter;
- `GrammarSpec.llguidance(grammar)`: a top-level grammar as llguidance's JSON (`{"grammars": [...]}`).

Lazy activation (`spec.lazy(trigger)`, what `tool_choice: auto` needs): the output is free text until
`trigger` first appears in it, then the grammar constrains the text that follows the trigger (the
trigger itself is the end of the free text: a grammar for `<tool_call>{...}</tool_call>` given the
trigger `<tool_call>` is the grammar of `{...}</tool_call>`). The trigger is found as text or as the
one token that spells it. The output may also end (end of sequence) while still free.

Reasoning is a request's, not a grammar's: `SamplingParams.reasoning_end` (e.g. "</think>") makes the
output before that marker a reasoning block, in which no grammar applies; the grammar (and a lazy
trigger) applies to what follows the marker, after up to 4 whitespace characters.

No torch here, and llguidance is imported only by the constructors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# The JSON compiler's settings the constructors start from; a schema's own "x-guidance" overrides them.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on a request's output: `grammar` is llguidance's top-level grammar (JSON text);
    `kind` names what it was built from ("json_schema", "json_object", "regex", "lark", "gbnf",
    "llguidance"), for messages and the monitor; `trigger`, when set, makes it lazy (module doc)."""

    grammar: str = field(repr=False)  # often long: a repr names the kind
    kind: str
    trigger: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar:
            raise ValueError("GrammarSpec.grammar must be llguidance's grammar as non-empty JSON text")
        if self.trigger is not None and (not isinstance(self.trigger, str) or not self.trigger):
            raise ValueError(f"GrammarSpec.trigger must be a non-empty string, got {self.trigger!r}")

    def lazy(self, trigger: str) -> GrammarSpec:
        """The same grammar, applied only to the text after `trigger` once it appears in the output."""
        return replace(self, trigger=trigger)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, *, strict: bool = True) -> GrammarSpec:
        """A JSON value that validates against `schema` (a mapping or its JSON text)."""
        from llguidance import LLMatcher

        if isinstance(schema, str):
            schema = _parse_json(schema, "the JSON schema")
        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        overrides = {"lenient": not strict}
        return cls(LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_DEFAULTS, overrides=overrides),
                   "json_schema")

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object."""
        return replace(cls.json_schema({"type": "object"}), kind="json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """Text that matches `pattern` as a whole."""
        from llguidance import LLMatcher

        _check_text(pattern, "the regex")
        return cls(LLMatcher.grammar_from_regex(pattern), "regex")

    @classmethod
    def lark(cls, text: str) -> GrammarSpec:
        """A grammar in llguidance's Lark syntax (its `start` rule)."""
        _check_text(text, "the Lark grammar")
        return cls(_lark_grammar(text), "lark")

    @classmethod
    def gbnf(cls, text: str) -> GrammarSpec:
        """A llama.cpp GBNF grammar (its `root` rule); ValueError naming where it does not convert."""
        from llguidance.gbnf_to_lark import any_to_lark

        _check_text(text, "the GBNF grammar")
        try:
            lark = any_to_lark(text)
        except Exception as exc:  # the converter raises its own error types, and assertions
            raise ValueError(f"the GBNF grammar does not convert: {exc}") from None
        return cls(_lark_grammar(lark), "gbnf")

    @classmethod
    def llguidance(cls, grammar: Mapping[str, Any] | str) -> GrammarSpec:
        """llguidance's own top-level grammar: `{"grammars": [{"lark_grammar": ...} | {"json_schema": ...}]}`."""
        value = _parse_json(grammar, "the llguidance grammar") if isinstance(grammar, str) else grammar
        if not isinstance(value, Mapping) or not isinstance(value.get("grammars"), list) or not value["grammars"]:
            raise ValueError('an llguidance grammar must be an object with a non-empty "grammars" list')
        return cls(json.dumps(value), "llguidance")


def _lark_grammar(text: str) -> str:
    """A Lark grammar as llguidance's top-level grammar (llguidance's own `grammar_from_lark` leaves it as
    Lark text, which cannot be composed with a reasoning block or a trigger)."""
    return json.dumps({"grammars": [{"lark_grammar": text}]})


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


def _check_text(text: str, what: str) -> None:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what} must be a non-empty string")
