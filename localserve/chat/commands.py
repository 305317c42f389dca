"""The settings of a `localserve chat` session and the slash commands that change them."""

from __future__ import annotations

from dataclasses import dataclass

HELP = """\
/help          this list
/reset         start a new conversation (the server forgets nothing, this chat just stops continuing it)
/system TEXT   the system prompt for the next replies (/system alone removes it)
/temp X        sampling temperature for the next replies, 0 to 2 (0 is greedy; /temp alone: the server's)
/max N         at most N tokens per reply (/max alone: the server's limit)
/quit          leave (Ctrl-D does too)
Ctrl-C stops a reply; up and down recall earlier lines."""


class QuitChat(Exception):
    """The user asked to leave."""


@dataclass
class ChatSettings:
    """What the next `response.create` carries besides the user's text."""

    instructions: str | None = None
    temperature: float | None = None  # None: the server's default
    max_output_tokens: int | None = None  # None: the server's default
    previous_response_id: str | None = None  # the conversation to continue

    def create_fields(self) -> dict[str, object]:
        """The fields of `response.create` that are set."""
        fields = {"instructions": self.instructions, "temperature": self.temperature,
                  "max_output_tokens": self.max_output_tokens, "previous_response_id": self.previous_response_id}
        return {name: value for name, value in fields.items() if value is not None}

    def run_command(self, line: str) -> str:
        """Apply the slash command `line`; returns what to tell the user. Raises QuitChat for /quit,
        ValueError (with a message for the user) for a command it cannot apply."""
        name, _, argument = line.strip().partition(" ")
        argument = argument.strip()
        if name == "/help":
            return HELP
        if name == "/quit":
            raise QuitChat
        if name == "/reset":
            self.previous_response_id = None
            return "new conversation"
        if name == "/system":
            self.instructions = argument or None
            return f"system prompt: {argument}" if argument else "no system prompt"
        if name == "/temp":
            self.temperature = _number(argument, "/temp", float, 0.0, 2.0) if argument else None
            return f"temperature {self.temperature:g}" if argument else "temperature: the server's default"
        if name == "/max":
            self.max_output_tokens = _number(argument, "/max", int, 1, None) if argument else None
            return f"at most {self.max_output_tokens} tokens per reply" if argument else "max tokens: the server's"
        raise ValueError(f"unknown command {name} (/help lists them)")


def _number(text: str, command: str, kind: type, low: float, high: float | None):
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{command} needs {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if not (low <= value and (high is None or value <= high)):  # written so that NaN is refused too
        bounds = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
        raise ValueError(f"{command} must be {bounds}, got {text}")
    return value
