"""Model outputs written the way each family's template writes an assistant turn, and hypothesis strategies.

`write_answer(format_name, content, calls)` is the text a model of that family produces for an answer with
`content` and `calls` (pairs of function name and arguments), spelled as the family's chat template spells an
assistant message with `tool_calls` (tests/tokenizer/test_chat_families.py checks that against the templates).
`write_reasoning` puts a `<think>` block before it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import strategies as st

from localserve.tokenizer.tools import ToolSpec

Call = tuple[str, dict[str, Any]]

# The tools the format tests offer: descriptions and argument descriptions with non-ASCII text, one optional
# argument.
WEATHER = ToolSpec("get_weather", "Current weather in a city, in °C", {
    "type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"},
                                     "days": {"type": "integer", "description": "how many days"}},
    "required": ["city"]})
SEARCH = ToolSpec("search", "Search the web", {
    "type": "object", "properties": {"query": {"type": "string", "description": "what to look for"}},
    "required": ["query"]})

MISTRAL_WRITTEN_ID = "a1B2c3D4e"


def write_answer(format_name: str, content: str, calls: list[Call]) -> str:
    """The answer text of `format_name` for `content` then `calls`."""
    return WRITERS[format_name](content, calls)


def write_reasoning(reasoning: str, answer: str, opened_in_prompt: bool = False) -> str:
    """`<think>` reasoning then the answer, as Qwen3 writes them (R1's prompt opens the block itself)."""
    return ("" if opened_in_prompt else "<think>\n") + f"{reasoning}\n</think>\n\n{answer}"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # the templates' tojson


def _hermes(content: str, calls: list[Call]) -> str:
    blocks = [f'<tool_call>\n{{"name": "{name}", "arguments": {_json(arguments)}}}\n</tool_call>'
              for name, arguments in calls]
    return "\n".join(([content] if content else []) + blocks)


def _coder_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return _json(value)
    return str(value)  # jinja's `string` filter: Python's str (True, 1.5)


def _qwen3_coder(content: str, calls: list[Call]) -> str:
    blocks = []
    for name, arguments in calls:
        parameters = "".join(f"<parameter={key}>\n{_coder_value(value)}\n</parameter>\n"
                             for key, value in arguments.items())
        blocks.append(f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>")
    if not blocks:
        return content
    return (content + "\n\n" if content else "") + "\n".join(blocks)


def _llama3_json(content: str, calls: list[Call]) -> str:
    assert not (content and calls) and len(calls) <= 1, "a Llama 3 message is one call or content"
    if not calls:
        return content
    name, arguments = calls[0]
    return f'{{"name": "{name}", "parameters": {_json(arguments)}}}'


def _mistral_array(content: str, calls: list[Call]) -> str:
    if not calls:
        return content
    items = [_json({"name": name, "arguments": arguments})[:-1] + f', "id": "{MISTRAL_WRITTEN_ID}"}}'
             for name, arguments in calls]
    return content + "[TOOL_CALLS][" + ", ".join(items) + "]"


def _mistral_args(content: str, calls: list[Call]) -> str:
    return content + "".join(f"[TOOL_CALLS]{name}[CALL_ID]{MISTRAL_WRITTEN_ID}[ARGS]{_json(arguments)}"
                             for name, arguments in calls)


def _generic_json(content: str, calls: list[Call]) -> str:
    if not calls:
        return _json({"response": content})
    if len(calls) == 1:
        return _json({"tool_call": {"name": calls[0][0], "arguments": calls[0][1]}})
    return _json({"tool_calls": [{"name": name, "arguments": arguments} for name, arguments in calls]})


def gemma4_value(value: Any) -> str:
    """A value as Gemma 4's template writes call arguments (`format_argument`): strings between `<|"|>`, keys
    bare (quoted where a key is no name: the notation has no other way to hold one), lists and objects."""
    if isinstance(value, str):
        return f'<|"|>{value}<|"|>'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "None"  # Jinja's rendering of None
    if isinstance(value, dict):
        keys = {key: key if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else gemma4_value(key) for key in value}
        return "{" + ",".join(f"{keys[key]}:{gemma4_value(item)}" for key, item in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma4_value(item) for item in value) + "]"
    return json.dumps(value)


def in_written_order(format_name: str, calls: list[Call]) -> list[Call]:
    """`calls` with their arguments' keys in the order the format writes them (Gemma 4's template sorts them)."""
    def ordered(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: ordered(value[key]) for key in sorted(value)}
        return [ordered(item) for item in value] if isinstance(value, list) else value

    return [(name, ordered(arguments)) for name, arguments in calls] if format_name == "gemma4" else calls


def _gemma4(content: str, calls: list[Call]) -> str:
    return content + "".join(f"<|tool_call>call:{name}{gemma4_value(arguments)}<tool_call|>"
                             for name, arguments in calls)


WRITERS = {"gemma4": _gemma4, "hermes": _hermes, "qwen3_coder": _qwen3_coder, "llama3_json": _llama3_json,
           "mistral_array": _mistral_array, "mistral_args": _mistral_args, "json": _generic_json}

# Text that looks like the formats' markers without being one, and characters that need escaping in JSON.
TRICKY = ["<tool", "<tool_call", "</tool_call", "<think", "</think", "[TOOL", "[TOOL_CALLS", "[ARGS", "{", "}",
          "[", "]", '"', "\\", "<", ">", "=", "é", "😀", "世界", "\n", " ", "<function", "<parameter"]


def plain_text(min_size: int = 0) -> st.SearchStrategy[str]:
    """Text with marker-like pieces, no surrounding whitespace, never a whole marker."""
    pieces = st.lists(st.one_of(st.sampled_from(TRICKY), st.text(alphabet="abc xyz.,!?0", min_size=1)),
                      min_size=min_size, max_size=8)
    markers = ("<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
               "<function=", "<parameter=", "</parameter>", "</function>")
    return pieces.map(lambda parts: "".join(parts).strip()).filter(
        lambda text: len(text) >= min_size and not any(marker in text for marker in markers))


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                         st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=12))


def json_arguments() -> st.SearchStrategy[dict[str, Any]]:
    """Arguments objects: nested values, strings with quotes, escapes and markers."""
    values = st.recursive(st.one_of(JSON_SCALARS, plain_text()),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                          max_leaves=8)
    return st.dictionaries(st.text(alphabet="abcdefgh_", min_size=1, max_size=8), values, max_size=4)
