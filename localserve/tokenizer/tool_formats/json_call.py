"""One tool call written as a JSON object (`{"name": "f", "arguments": {...}}`), read as it streams.

The call opens once its name is complete; the arguments' raw JSON text goes out in pieces as it comes (held
back only while the name, written after them, is not known yet).
"""

from __future__ import annotations

from localserve.tokenizer.json_stream import JsonObjectReader, JsonStringDecoder, MemberEnd, MemberKey, MemberPiece
from localserve.tokenizer.tool_formats.base import CallEvents

__all__ = ["JsonCallReader"]


class JsonCallReader:
    """Reads one call object into `events`: the name from `"name"`, the arguments from the first of
    `argument_keys`; other members are skipped. `first_keys`, when given, are the keys a call may begin with:
    an object beginning with another key is not a call (`malformed`, nothing emitted)."""

    def __init__(self, events: CallEvents, argument_keys: tuple[str, ...] = ("arguments", "parameters"),
                 first_keys: tuple[str, ...] | None = None) -> None:
        self._events = events
        self._object = JsonObjectReader()
        self._argument_keys = argument_keys
        self._first_keys = first_keys
        self._keys_seen = 0
        self._name: JsonStringDecoder | None = None
        self._name_text = ""
        self._arguments_key: str | None = None
        self._held_arguments: list[str] = []
        self.opened = False
        self.consumed = ""  # the text read before the call opened, to give back as content if it never does
        self.not_a_call = False

    @property
    def done(self) -> bool:
        """The object is complete."""
        return self._object.done

    @property
    def malformed(self) -> bool:
        """The text stopped being a call object (`rest` holds it from there)."""
        return self._object.malformed or self.not_a_call

    @property
    def rest(self) -> str:
        """The text after the object once `done`, or from where it stopped once `malformed`."""
        return self._object.rest

    def feed(self, text: str) -> None:
        """Read the next piece of the object's text."""
        if not self.opened:
            self.consumed += text
        for part in self._object.feed(text):
            if isinstance(part, MemberKey):
                self._keys_seen += 1
                if self._keys_seen == 1 and self._first_keys is not None and part.key not in self._first_keys:
                    self.not_a_call = True
                    return
                if self._arguments_key is None and part.key in self._argument_keys:
                    self._arguments_key = part.key
            elif isinstance(part, MemberPiece) and part.key == "name" and not self.opened:
                self._name = self._name or JsonStringDecoder()
                self._name_text += self._name.feed(part.text)
            elif isinstance(part, MemberEnd) and part.key == "name" and not self.opened:
                self._open()
            elif isinstance(part, MemberPiece) and part.key == self._arguments_key:
                if self.opened:
                    self._events.arguments(part.text)
                else:
                    self._held_arguments.append(part.text)
        if self._object.done and self.opened:
            if self._arguments_key is None:
                self._events.arguments("{}")
            self._events.close()
        elif self._object.done:
            self.not_a_call = True  # an object without a name

    def _open(self) -> None:
        self._events.open(self._name_text)
        self.opened, self.consumed = True, ""
        for piece in self._held_arguments:
            self._events.arguments(piece)
        self._held_arguments = []
