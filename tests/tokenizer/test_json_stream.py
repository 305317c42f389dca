"""Reading JSON in pieces: where values end, members and elements with their raw text, strings decoded."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.tokenizer.json_stream import (
    ElementEnd,
    ElementPiece,
    JsonArrayReader,
    JsonObjectReader,
    JsonStringDecoder,
    JsonValueScanner,
    MemberEnd,
    MemberKey,
    MemberPiece,
)

JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text()),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)),
    max_leaves=10)


def pieces_of(text: str) -> st.SearchStrategy[list[str]]:
    return st.lists(st.integers(0, len(text)), max_size=8).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)], strict=True)])


def test_a_value_ends_where_its_structure_closes():
    value = '{"a": "}\\"", "b": [1, {}]}'
    assert JsonValueScanner().feed(value + " tail") == len(value)
    assert JsonValueScanner().feed('"a\\\\" rest') == 5
    assert JsonValueScanner().feed("123, 4") == 3
    scanner = JsonValueScanner()
    assert scanner.feed('[1, "]') is None and scanner.feed('"]x') == 2


def test_object_members_come_as_keys_raw_pieces_and_ends():
    reader = JsonObjectReader()
    parts = reader.feed(' {"na') + reader.feed('me": "f", "ar') + reader.feed('gs": {"x": [1]}} after')
    assert parts == [MemberKey("name"), MemberPiece("name", '"f"'), MemberEnd("name"), MemberKey("args"),
                     MemberPiece("args", '{"x": [1]}'), MemberEnd("args")]
    assert reader.done and reader.rest == " after"
    broken = JsonObjectReader()
    broken.feed('{"a" 1}')
    assert broken.malformed and broken.rest == "1}"


def test_strings_decode_with_escapes_split_anywhere():
    raw = json.dumps('é "q" \\ 😀 \n', ensure_ascii=True)
    for cut in range(len(raw) + 1):
        decoder = JsonStringDecoder()
        assert decoder.feed(raw[:cut]) + decoder.feed(raw[cut:]) == 'é "q" \\ 😀 \n' and decoder.closed


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=4), st.booleans(), st.data())
def test_generated_objects_read_back_member_by_member(value, ascii_only, data):
    text = json.dumps(value, ensure_ascii=ascii_only)
    reader = JsonObjectReader()
    parts = [part for piece in data.draw(pieces_of(text + " ")) for part in reader.feed(piece)]
    keys = [part.key for part in parts if isinstance(part, MemberKey)]
    assert keys == list(value) and reader.done and reader.rest.strip() == ""
    for key in value:
        raw = "".join(part.text for part in parts if isinstance(part, MemberPiece) and part.key == key)
        assert json.loads(raw) == value[key]
    assert sum(isinstance(part, MemberEnd) for part in parts) == len(value)


@settings(max_examples=100, deadline=None)
@given(st.lists(JSON_VALUES, max_size=4), st.data())
def test_generated_arrays_read_back_element_by_element(value, data):
    text = json.dumps(value)
    reader = JsonArrayReader()
    parts = [part for piece in data.draw(pieces_of(text)) for part in reader.feed(piece)]
    elements = ["".join(p.text for p in parts if isinstance(p, ElementPiece) and p.index == index)
                for index in range(len(value))]
    assert [json.loads(element) for element in elements] == value and reader.done
    assert [p.index for p in parts if isinstance(p, ElementEnd)] == list(range(len(value)))


@settings(max_examples=150, deadline=None)
@given(st.text(), st.booleans(), st.data())
def test_generated_strings_decode_from_any_split(text, ascii_only, data):
    decoder = JsonStringDecoder()
    pieces = data.draw(pieces_of(json.dumps(text, ensure_ascii=ascii_only)))
    assert "".join(decoder.feed(piece) for piece in pieces) == text and decoder.closed
