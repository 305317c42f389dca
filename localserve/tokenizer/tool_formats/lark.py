"""Pieces of Lark grammars in llguidance's syntax, shared by the tool-call formats.

llguidance reads a Lark dialect: string literals as JSON strings, regular expressions between slashes (with
`&` and `~` for intersection and negation in terminal definitions), `%json {schema}` for a JSON value that
follows a schema, `<[id]>` for one token by id, and `rule[lazy]: ...` for a lexeme that ends as soon as it can
(docs/syntax.md in llguidance's repository).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ANY_TEXT", "TEMPLATE_JSON", "WS", "calls_grammar", "json_value", "literal", "marker", "regex_literal"]

# Whitespace between and after calls, bounded: a small model may otherwise go on writing newlines after a
# complete call until its token limit (the grammar could never end).
WS = r"WS: /[ \t\r\n]{1,4}/"
ANY_TEXT = r"ANY_TEXT: /(?s:.*)/"
# JSON laid out as the templates' `tojson` writes it (a `%json` schema's "x-guidance" settings)
TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/")


def literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def regex_literal(text: str) -> str:
    """`text` escaped for use inside a /regex/."""
    return "".join("\\" + char if char in REGEX_SPECIAL else char for char in text)


def marker(text: str, token_ids: Mapping[str, int]) -> str:
    """A marker of a format: its token (`<[id]>`) when it is one added token of the vocabulary, else its text."""
    token_id = token_ids.get(text)
    return f"<[{token_id}]>" if token_id is not None else literal(text)


def json_value(schema: Mapping[str, Any]) -> str:
    """A JSON value that follows `schema`."""
    return "%json " + json.dumps(schema, ensure_ascii=False)


def calls_grammar(opener: str, trigger: str, call_rules: Sequence[str], call: str, *, lazy: bool,
                  parallel: bool, answer: Mapping[str, Any] | None = None) -> str:
    """An answer of calls that each begin with `opener` (the marker's grammar text, `trigger` its text) and go on
    as rule `call`, defined in `call_rules` (which may use the terminals `WS` and `ANY_TEXT`); whitespace between
    and after the calls, nothing else.

    `lazy` (tool_choice auto): free text first, then, if the trigger comes, the calls; text free of the trigger
    is a whole answer too. Otherwise the answer is the calls alone, or, with `answer` (a JSON schema: tool_choice
    auto beside an answer format), a JSON value of that schema instead. `parallel` false: one call at most.
    """
    more = f"(WS? {opener} {call})*" if parallel else ""
    free_text = f"FREE_TEXT: /(?s:.*)/ & ~/(?s:.*){regex_literal(trigger)}(?s:.*)/"
    if answer is not None:
        lines = [f"start: answer | WS? {opener} {call} {more} WS?", f"answer: {json_value(answer)}"]
    elif not lazy:
        lines = [f"start: WS? {opener} {call} {more} WS?"]
    elif opener.startswith("<["):  # a token: free text (never the trigger spelled out) ends where it comes
        lines = [f"start: FREE_TEXT ({opener} {call} {more} WS?)?", free_text]
    else:
        lines = [f"start: FREE_TEXT | text_then_trigger {call} {more} WS?", free_text,
                 f"text_then_trigger[lazy]: ANY_TEXT {literal(trigger)}"]
    rules = [*lines, *call_rules]
    any_text = [ANY_TEXT] if any("ANY_TEXT" in rule for rule in rules) else []
    return "\n".join(["%llguidance {}", *rules, *any_text, WS]) + "\n"
