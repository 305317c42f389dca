"""A conversation's messages as each API spells them, checked into {"role", "content"} (no I/O here).

`MessageFormat` says what one API's messages may hold (content part types, a bare string, item
types, roles and fields it cannot honour); `parse_messages` is the one parser of them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from localserve.server.request_model import Message, RequestLimits
from localserve.server.validation import ProtocolError, check_length, check_type, shown

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass(frozen=True)
class MessageFormat:
    """How one API spells a conversation's messages."""

    text_parts: tuple[str, ...]  # the content part types that carry text
    bare_string: bool = False  # a string is one user message
    at_least_one: bool = False
    item_types: tuple[str, ...] = ()  # the `type` an item may name (the first when it names none)
    refused_roles: Mapping[str, str] = field(default_factory=dict)  # role -> why it is not supported
    refused_fields: tuple[str, ...] = ()  # message fields that would need more than text
    unused_text_fields: tuple[str, ...] = ()  # strings accepted and not used (a participant's name)
    null_assistant_content: bool = False  # an assistant message's content may be null


def parse_messages(value: Any, param: str, form: MessageFormat, limits: RequestLimits) -> list[Message]:
    """The messages of `value`, checked, as {"role", "content"} with the roles user/assistant/system."""
    if form.bare_string and isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ProtocolError("invalid_type", f"'{param}' must be {'a string or ' if form.bare_string else ''}an "
                            "array of messages", param)
    if form.at_least_one and not value:
        raise ProtocolError("invalid_value", f"'{param}' must hold at least one message", param)
    check_length(value, param, limits.max_input_items)
    return [_message(item, f"{param}[{index}]", form) for index, item in enumerate(value)]


def _message(item: Any, where: str, form: MessageFormat) -> Message:
    if not isinstance(item, dict):
        raise ProtocolError("invalid_type", f"'{where}' must be a message object", where)
    if form.item_types:
        kind = check_type(item, "type", str, f"{where}.type") or form.item_types[0]
        if kind not in form.item_types:
            raise ProtocolError("unsupported_value", f"'{where}.type' {shown(kind)} is not supported: this "
                                "server takes text messages only", f"{where}.type")
    role = check_type(item, "role", str, f"{where}.role")
    if role in form.refused_roles:
        raise ProtocolError("unsupported_value", f"'{where}.role' {role!r} is not supported: "
                            f"{form.refused_roles[role]}", f"{where}.role")
    if role not in ROLES:
        raise ProtocolError("invalid_value", f"'{where}.role' must be one of {sorted(ROLES)}, got {shown(role)}",
                            f"{where}.role")
    for name in form.refused_fields:
        if item.get(name):
            raise ProtocolError("unsupported_value", f"'{where}.{name}' is not supported: this server takes "
                                "text messages only", f"{where}.{name}")
    for name in form.unused_text_fields:
        check_type(item, name, str, f"{where}.{name}")
    content = item.get("content")
    if isinstance(content, list):
        content = "".join(_part_text(part, f"{where}.content[{index}]", form) for index, part in enumerate(content))
    if content is None and role == "assistant" and form.null_assistant_content:
        content = ""
    if not isinstance(content, str):
        raise ProtocolError("invalid_type", f"'{where}.content' must be a string or an array of text parts",
                            f"{where}.content")
    return {"role": ROLES[role], "content": content}


def _part_text(part: Any, where: str, form: MessageFormat) -> str:
    if not isinstance(part, dict) or part.get("type") not in form.text_parts:
        kinds = " or ".join(repr(kind) for kind in form.text_parts)
        raise ProtocolError("unsupported_value", f"'{where}' must be a text part (type {kinds}): this server "
                            "takes text only", where)
    return check_type(part, "text", str, f"{where}.text") or ""
