"""Chat templates, rendered with jinja2 exactly the way Hugging Face transformers renders them.

A model's chat template is a jinja2 template that turns a list of messages into the prompt text the
model was trained on. Templates come from the hub, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment`, with the same settings, filters and globals that transformers gives
them (`trim_blocks`, `lstrip_blocks`, loop controls, its `tojson`, `raise_exception`, `strftime_now`),
so that a template renders here character for character as it does there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "compile_chat_template", "render_chat_template"]


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """A chat template that does not compile, fails while rendering, or calls `raise_exception`."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: no HTML escaping (unlike jinja2's own filter), with json.dumps' options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attribute names (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template once; later calls with the same text return the cached template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        problem = f"the chat template does not compile: {exc.message} (line {exc.lineno})"
    raise ChatTemplateError(problem)


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
                         documents: Sequence[Mapping[str, Any]] | None = None,
                         special_tokens: Mapping[str, str] | None = None, **kwargs: Any) -> str:
    """Render `messages` (dicts with "role" and "content") to prompt text, as transformers does.

    `special_tokens` are the tokenizer's named tokens (`bos_token`, `eos_token`, ...), which templates
    read as variables; extra keyword arguments reach the template too and override them.
    """
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    # Like transformers: keys whose value is None are dropped (APIs send `content=None` with tool calls), and a
    # message's reasoning goes under both names templates read it by (`reasoning_content`; gpt-oss's `thinking`).
    messages = [_with_reasoning_names({key: value for key, value in dict(m).items() if value is not None})
                for m in messages]
    variables = {**(special_tokens or {}), **kwargs}
    try:
        compiled = compile_chat_template(template)
        return compiled.render(messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {exc}") from None


REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning may come under, the one templates read first (transformers' order)."""


def _with_reasoning_names(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its reasoning (the first of REASONING_NAMES it holds) as `reasoning_content` and as
    `thinking`, which is what transformers' apply_chat_template hands a template."""
    reasoning = next((message[name] for name in REASONING_NAMES if name in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}
