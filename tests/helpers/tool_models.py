"""Scripted models (tests/helpers/scripted.py) that answer in a chat format: a Hermes-style template that offers
tools and renders tool turns, optionally a thinking one, and a reply written in that family's format.

The script follows the prompt's last token, which the template makes the end of sequence, or the beginning
of sequence after a tool result; so the model makes the calls a test picks, and after their results says the
answer it picks (the server's grammar must allow each token, or the sampled tokens leave the script).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.scripted import BOS, EOS, FIRST_PIECE, SPECIALS, VOCAB, Script, _write_weights, piece_tokenizer
from tests.helpers.server import make_llm, running_server

# Hermes-shaped (the server detects the format by `<tool_call>`): tools listed, calls and results rendered.
HERMES_TEMPLATE = (
    "{%- if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}; call with <tool_call>."
    "{% endif %}"
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "{%- if message.role == 'tool' %} (for {{ message.tool_call_id }}){% endif %}\n"
    "{%- endfor %}{% if messages[-1].role == 'tool' %}<s>{% else %}</s>{% endif %}")
# The same with Qwen3's thinking switch: the model writes its own <think> block unless thinking is off.
THINKING_TEMPLATE = HERMES_TEMPLATE.replace(
    "{% if messages[-1]", "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% if messages[-1]")


SINGLE_CHARACTERS = '{}[]":, 0123456789-.abcdefghijklmnopqrstuvwxyz'


def hermes_call(name: str, arguments: dict) -> str:
    """One call as a Hermes model writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def write_tool_model(folder: Path, calls: list[str], answer: list[str], template: str = HERMES_TEMPLATE) -> Script:
    """A scripted model with a chat `template`: after a prompt that ends with EOS it says the pieces `calls`,
    after one that ends with BOS (the templates here end so after a tool result) the pieces `answer`.

    Each piece is one token. A grammar's mask allows a token only where llguidance would tokenize the text the
    grammar forces the same way, and this vocabulary has no merges: so a piece may begin only where the grammar
    leaves a choice (free text, a string's characters, between calls), never inside a forced literal."""
    data = [piece.encode() for piece in calls + answer]
    assert len(set(data)) == len(data) and FIRST_PIECE + len(data) <= VOCAB, "pieces must differ and fit"
    ids = list(range(FIRST_PIECE, FIRST_PIECE + len(data)))
    call_ids, answer_ids = ids[:len(calls)], ids[len(calls):]
    # The rest of the vocabulary: single characters, so that any JSON a grammar forces can be spelled
    singles = [char.encode() for char in SINGLE_CHARACTERS if char.encode() not in data]
    fillers = singles[:VOCAB - FIRST_PIECE - len(data)]
    fillers += [f"<unused{i}>".encode() for i in range(FIRST_PIECE + len(data) + len(fillers), VOCAB)]
    backend = piece_tokenizer(SPECIALS, data + fillers)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template}))
    successor = {EOS: call_ids[0], BOS: answer_ids[0]}
    for script in (call_ids, answer_ids):
        successor.update(zip(script, script[1:]))
        successor[script[-1]] = EOS
    _write_weights(folder, successor, context_length=1024)
    return Script(folder, ids, [EOS])


# The scripted thinking model of the tool tests: it thinks, then calls get_weather and get_time; after the
# results it thinks again and answers.
WEATHER = hermes_call("get_weather", {"city": "Paris"})
TIME = hermes_call("get_time", {"zone": "CET"})
CUT = WEATHER.index("Par") + 3  # inside the city's string: a piece may start where the grammar leaves a choice
CALLS = ["<think>\nI should look.\n</think>\n\n", WEATHER[:CUT], WEATHER[CUT:], "\n", TIME]
ANSWER = ["<think>\nBoth came.\n</think>\n\n", "It is sunny ", "at noon."]
# long enough for full 16-token blocks: the follow-up's prompt begins with them
QUESTION = "what is the weather in paris and what time is it there " * 4

# The scripted model of the client tests (no thinking): it calls get_weather and writes whitespace after the call
# (the call grammar allows up to 4 characters of it); after the result it answers with a JSON object, the typed
# output an agent asks for.
PLAIN_CALLS = [WEATHER[:CUT], WEATHER[CUT:], "\n\n"]
JSON_ANSWER = ['{"city": "Paris", "summary": "sunny"}']
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}},
                                                                "required": ["city"]}}}
# A template without tool markers: the generic JSON format (the default model SmolLM2's); a tool result is a
# user message holding {"tool_response": ...}, after which the prompt ends with BOS
GENERIC_TEMPLATE = (
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{%- if messages[-1].content.startswith('{\"tool_response\"') %}<s>{% else %}</s>{% endif %}")
GENERIC_CALLS = ['{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}', "\n\n"]
GENERIC_ANSWER = ['{"response": "It is sunny."}']


@contextmanager
def scripted_tool_server(folder: Path, calls: list[str], answer: list[str], template: str = HERMES_TEMPLATE,
                         alias: str = "tools") -> Iterator:
    """A server (tests/helpers/server.py's running_server) of the scripted model `write_tool_model` writes into
    `folder`, served as `alias`."""
    write_tool_model(folder, calls, answer, template)
    with running_server(make_llm(folder, max_model_len=1024), model_alias=alias) as server:
        yield server
