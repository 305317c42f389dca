"""Chat templates render exactly as transformers' `apply_chat_template(..., tokenize=False)`."""

from __future__ import annotations

import datetime

import pytest

from localserve.tokenizer.chat_template import ChatTemplateError, compile_chat_template, render_chat_template
from localserve.tokenizer.tokenizer import Tokenizer
from tests.helpers.tokenizers import (
    CHATML_SPECIALS,
    LLAMA3_SPECIALS,
    reference_for,
    smollm2_reference,
    smollm2_tokenizer,
    template,
    train_bpe,
)

SYSTEM = {"role": "system", "content": "You are terse. Answer in one word."}
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "  And of Italy? Ünïcödé 😀 \"quotes\" & <tags>  "},
]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[Tokenizer, object]]:
    """(ours, transformers') per template: SmolLM2's from its GGUF, and the Llama 3.1 / Qwen2.5 fixtures."""
    llama = train_bpe(LLAMA3_SPECIALS)
    qwen = train_bpe(CHATML_SPECIALS)
    llama_special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    qwen_special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}  # Qwen2.5 has no BOS token
    return {
        "smollm2": (smollm2_tokenizer(), smollm2_reference()),
        "llama3": (Tokenizer(llama, special_tokens=llama_special, chat_template=template("llama3.jinja")),
                   reference_for(llama, template("llama3.jinja"), **llama_special)),
        "qwen2": (Tokenizer(qwen, special_tokens=qwen_special, chat_template=template("qwen2.jinja")),
                  reference_for(qwen, template("qwen2.jinja"), **qwen_special)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2"])
@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["gen-prompt", "no-gen-prompt"])
def test_matches_transformers(pairs, name, system, generation_prompt):
    ours, reference = pairs[name]
    messages = [SYSTEM, *CONVERSATION] if system else CONVERSATION
    gen = generation_prompt
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    # and tokenized as transformers tokenizes a chat (no user text spells a special token here)
    expected_ids = reference.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False)
    assert ours.encode_chat(messages, add_generation_prompt=gen) == list(expected_ids)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_tools_and_tool_calls_match_transformers(pairs, name):
    ours, reference = pairs[name]
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Zürich"}}}], "content": None}
    messages = [SYSTEM, {"role": "user", "content": "Weather in Zürich?"}, call,
                {"role": "tool", "content": "{\"temp_c\": 21}"}]
    expected = reference.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False,
                                             add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tools=[WEATHER_TOOL]) == expected
    assert "Zürich" in expected  # tojson keeps non-ASCII as is (ensure_ascii=False)
    if name == "llama3":  # date_string as an extra template variable
        kwargs = {"date_string": "01 Jan 2025"}
        assert ours.apply_chat_template(CONVERSATION, **kwargs) == reference.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=True, **kwargs)


FEATURES = (
    "{% set ns = namespace(count=0) %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}{% set ns.count = ns.count + 1 %}\n"
    "  {{ m.content | tojson }}|{{ {'b': 1, 'a': 'é<&>'} | tojson(sort_keys=true, separators=(',', ':')) }}\n"
    "{% endfor %}{{ {'x': [1, 2]} | tojson(indent=2) }}{{ ns.count }}{{ bos_token ~ eos_token }}"
    "{{ dict(a=1) | tojson }}{% if add_generation_prompt %}<go>{% endif %}"
)


@pytest.mark.slow
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_jinja_features_match_transformers(generation_prompt):
    backend = train_bpe(CHATML_SPECIALS, vocab_size=300)
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    reference = reference_for(backend, FEATURES, **special)
    messages = [SYSTEM, *CONVERSATION, {"role": "user", "content": "cut by break"}]
    gen = generation_prompt
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    ours = Tokenizer(backend, special_tokens=special, chat_template=FEATURES)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    assert '"é<&>"' in expected and "cut by break" not in expected


def test_strftime_now_and_raise_exception():
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert render_chat_template("{{ strftime_now('%d %b %Y') }}", [{"role": "user", "content": "x"}]) == today
    refusing = ("{% if messages[0].role != 'system' %}"
                "{{ raise_exception('a system message comes first') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="refused the conversation: a system message comes first"):
        render_chat_template(refusing, [{"role": "user", "content": "hi"}])


def test_errors_are_clear():
    with pytest.raises(ChatTemplateError, match=r"does not compile: .*\(line 1\)"):
        compile_chat_template("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render_chat_template("{{ messages }}", [])
    with pytest.raises(ChatTemplateError, match="failed to render: list object has no element 5"):
        render_chat_template("{{ messages[5].content.strip() }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="failed to render: .*unsafe"):  # the sandbox is immutable
        render_chat_template("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="failed to render: .*cannot set namespace attribute '_x'"):
        render_chat_template("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}])


def test_templates_are_compiled_once():
    text = "{{ messages | length }}"
    assert compile_chat_template(text) is compile_chat_template(text)


def test_none_values_are_dropped_like_transformers():
    text = "{% for m in messages %}{{ m.content if m.content is defined else 'none' }}{% endfor %}"
    assert render_chat_template(text, [{"role": "assistant", "content": None}]) == "none"
