"""Reading JSON that arrives in pieces, without waiting for the end: where a value ends, an object's members,
an array's elements, a string's decoded text.

The readers follow JSON's structure (strings and their escapes, nesting) to know where things end, and pass
each value's raw text on as it comes; they do not validate what they pass on (a constrained output is valid
by construction, and a free one is shown as the model wrote it). A reader that meets text which cannot be the
structure it reads stops there, `malformed`, and keeps the text from that point in `rest`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["ElementEnd", "ElementPiece", "JsonArrayReader", "JsonObjectReader", "JsonStringDecoder",
           "JsonValueScanner", "MemberEnd", "MemberKey", "MemberPiece"]

WHITESPACE = " \t\r\n"
SCALAR_END = WHITESPACE + ",}]"


class JsonValueScanner:
    """Finds where one JSON value ends in text fed piece by piece (the first piece starts at the value)."""

    def __init__(self) -> None:
        self._started = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._scalar = False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the value's end, or None when the value goes on past `text`.

        A number or literal ends before the first character that cannot be part of it (that character is
        not the value's), so the index may be that of a delimiter.
        """
        for index, char in enumerate(text):
            if not self._started:
                self._started = True
                if char == '"':
                    self._in_string = True
                elif char in "{[":
                    self._depth = 1
                else:
                    self._scalar = True
            elif self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return index + 1
            elif self._scalar:
                if char in SCALAR_END:
                    return index
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return index + 1
        return None


@dataclass(frozen=True, slots=True)
class MemberKey:
    """A member's key, complete."""

    key: str


@dataclass(frozen=True, slots=True)
class MemberPiece:
    """The next raw JSON text of the value of member `key`."""

    key: str
    text: str


@dataclass(frozen=True, slots=True)
class MemberEnd:
    """The value of member `key` is complete."""

    key: str


class JsonObjectReader:
    """One JSON object, member by member: each key once complete, its value's raw text in pieces, its end.

    `done` once the closing brace is read, with the text after it in `rest`; `malformed` when the text stops
    being an object (then `rest` is the text from where it stopped).
    """

    def __init__(self) -> None:
        self._state = "start"
        self._key_raw = ""
        self._key = ""
        self._key_escape = False
        self._value: JsonValueScanner | None = None
        self.done = False
        self.malformed = False
        self.rest = ""

    def feed(self, text: str) -> list[MemberKey | MemberPiece | MemberEnd]:
        """Read `text`; what it completed, in order."""
        parts: list[MemberKey | MemberPiece | MemberEnd] = []
        index = 0
        while index < len(text) and not (self.done or self.malformed):
            char = text[index]
            state = self._state
            if state == "value":
                end = self._value.feed(text[index:])
                piece = text[index:] if end is None else text[index:index + end]
                parts.append(MemberPiece(self._key, piece))
                if end is None:
                    return parts
                parts.append(MemberEnd(self._key))
                self._state, index = "after_value", index + end
                continue
            if state == "key":
                if self._key_escape:
                    self._key_escape = False
                elif char == "\\":
                    self._key_escape = True
                elif char == '"':
                    self._key = _decode_string(self._key_raw)
                    parts.append(MemberKey(self._key))
                    self._state = "colon"
                    index += 1
                    continue
                self._key_raw += char
            elif char in WHITESPACE:
                pass
            elif state == "start" and char == "{":
                self._state = "key_or_end"
            elif state in ("key_or_end", "key_after_comma") and char == '"':
                self._state, self._key_raw = "key", ""
            elif state == "key_or_end" and char == "}":
                self._finish(text[index + 1:])
            elif state == "colon" and char == ":":
                self._state = "value_start"
            elif state == "value_start":
                self._state, self._value = "value", JsonValueScanner()
                continue  # the value's first character is read by its scanner
            elif state == "after_value" and char == ",":
                self._state = "key_after_comma"
            elif state == "after_value" and char == "}":
                self._finish(text[index + 1:])
            else:
                self.malformed, self.rest = True, text[index:]
            index += 1
        return parts

    def _finish(self, rest: str) -> None:
        self.done, self.rest = True, rest


@dataclass(frozen=True, slots=True)
class ElementPiece:
    """The next raw JSON text of element `index` of an array."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ElementEnd:
    """Element `index` is complete."""

    index: int


class JsonArrayReader:
    """One JSON array, element by element: each element's raw text in pieces, then its end.

    `done`, `malformed` and `rest` as in `JsonObjectReader`.
    """

    def __init__(self) -> None:
        self._state = "start"
        self._count = 0
        self._value: JsonValueScanner | None = None
        self.done = False
        self.malformed = False
        self.rest = ""

    def feed(self, text: str) -> list[ElementPiece | ElementEnd]:
        """Read `text`; what it completed, in order."""
        parts: list[ElementPiece | ElementEnd] = []
        index = 0
        while index < len(text) and not (self.done or self.malformed):
            char = text[index]
            if self._state == "element":
                end = self._value.feed(text[index:])
                piece = text[index:] if end is None else text[index:index + end]
                parts.append(ElementPiece(self._count, piece))
                if end is None:
                    return parts
                parts.append(ElementEnd(self._count))
                self._count += 1
                self._state, index = "after_element", index + end
                continue
            if char in WHITESPACE:
                pass
            elif self._state == "start" and char == "[":
                self._state = "element_or_end"
            elif self._state in ("element_or_end", "after_element") and char == "]":
                self.done, self.rest = True, text[index + 1:]
            elif self._state == "after_element" and char == ",":
                self._state = "element_after_comma"
            elif self._state in ("element_or_end", "element_after_comma"):
                self._state, self._value = "element", JsonValueScanner()
                continue
            else:
                self.malformed, self.rest = True, text[index:]
            index += 1
        return parts


class JsonStringDecoder:
    """The decoded text of one JSON string value whose raw text (quotes included) arrives in pieces.

    An escape split across pieces (`\\`, `\\u00`, the two halves of a surrogate pair) is held back until it
    is complete, so every piece of text returned is final.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._opened = False
        self.closed = False

    def feed(self, raw: str) -> str:
        """Add raw text of the string; return the newly decoded text."""
        if not self._opened and raw:
            raw, self._opened = raw[1:], True  # the opening quote
        self._pending += raw
        complete, closes = _complete_prefix(self._pending)
        segment, self._pending = self._pending[:complete], self._pending[complete + int(closes):]
        self.closed = self.closed or closes
        return _decode_string(segment)


def _complete_prefix(raw: str) -> tuple[int, bool]:
    """How much of `raw` (the inside of a JSON string) decodes on its own, and whether a closing quote ends it."""
    index = 0
    while index < len(raw):
        char = raw[index]
        if char == '"':
            return index, True
        if char != "\\":
            index += 1
            continue
        if index + 1 >= len(raw):
            break
        if raw[index + 1] != "u":
            index += 2
            continue
        if index + 6 > len(raw):
            break
        if 0xD800 <= _hex(raw[index + 2:index + 6]) < 0xDC00:  # a high surrogate: its pair must come too
            if index + 12 > len(raw) and raw[index + 6:index + 8] in ("\\u", "\\", ""):
                break
        index += 6
    return index, False


def _hex(digits: str) -> int:
    try:
        return int(digits, 16)
    except ValueError:
        return -1


def _decode_string(raw: str) -> str:
    """The text of the inside of a JSON string; raw text that is not valid JSON is kept as it is."""
    if "\\" not in raw:
        return raw
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw
