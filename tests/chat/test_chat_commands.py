"""The slash commands of `localserve chat` (chat/commands.py) on their own: each command parsed into
the settings the next `response.create` carries, each bound at its limit (accepted) and past it (refused
with a message that says why), a refused command changing nothing. (tests/chat/test_chat_client.py
runs them through the client against a scripted server.)"""

from __future__ import annotations

import pytest

from localserve.chat.commands import HELP, ChatSettings, QuitChat


def test_help_and_quit():
    assert ChatSettings().run_command("/help") == HELP
    for command in ("/help", "/reset", "/system TEXT", "/temp X", "/max N", "/quit"):
        assert command in HELP
    with pytest.raises(QuitChat):
        ChatSettings().run_command("/quit")


def test_reset_starts_a_new_conversation_and_keeps_the_rest():
    settings = ChatSettings(instructions="be brief", temperature=0.5, previous_response_id="resp_1")
    assert settings.run_command("/reset") == "new conversation"
    assert settings == ChatSettings(instructions="be brief", temperature=0.5)


def test_system_sets_the_whole_text_and_alone_removes_it():
    settings = ChatSettings()
    assert settings.run_command("  /system   be brief, and kind  ") == "system prompt: be brief, and kind"
    assert settings.instructions == "be brief, and kind"
    assert settings.run_command("/system") == "no system prompt" and settings.instructions is None
    assert settings.run_command("/system    ") == "no system prompt" and settings.instructions is None


@pytest.mark.parametrize("argument, value, told", [
    ("0", 0.0, "temperature 0"), ("2", 2.0, "temperature 2"), ("0.7", 0.7, "temperature 0.7"),
    ("1e0", 1.0, "temperature 1"),
])
def test_temp_takes_a_number_from_0_to_2(argument, value, told):
    settings = ChatSettings()
    assert settings.run_command(f"/temp {argument}") == told
    assert settings.temperature == value
    assert settings.create_fields() == {"temperature": value}  # 0 (greedy) is sent, not taken for unset


@pytest.mark.parametrize("argument, message", [
    ("2.0001", "/temp must be between 0 and 2, got 2.0001"), ("-0.1", "/temp must be between 0 and 2, got -0.1"),
    ("inf", "/temp must be between 0 and 2, got inf"), ("nan", "/temp must be between 0 and 2, got nan"),
    ("warm", "/temp needs a number, got 'warm'"), ("0.5 1", "/temp needs a number, got '0.5 1'"),
])
def test_temp_refuses_what_is_no_number_from_0_to_2_and_keeps_the_last(argument, message):
    settings = ChatSettings(temperature=0.5)
    with pytest.raises(ValueError) as raised:
        settings.run_command(f"/temp {argument}")
    assert str(raised.value) == message
    assert settings.temperature == 0.5


def test_temp_alone_leaves_it_to_the_server():
    settings = ChatSettings(temperature=0.5)
    assert settings.run_command("/temp") == "temperature: the server's default"
    assert settings.temperature is None and "temperature" not in settings.create_fields()


@pytest.mark.parametrize("argument, value", [("1", 1), ("512", 512), (" 7 ", 7)])
def test_max_takes_a_whole_number_from_1(argument, value):
    settings = ChatSettings()
    assert settings.run_command(f"/max {argument}") == f"at most {value} tokens per reply"
    assert settings.max_output_tokens == value and settings.create_fields() == {"max_output_tokens": value}


@pytest.mark.parametrize("argument, message", [
    ("0", "/max must be at least 1, got 0"), ("-3", "/max must be at least 1, got -3"),
    ("1.5", "/max needs an integer, got '1.5'"), ("many", "/max needs an integer, got 'many'"),
])
def test_max_refuses_what_is_no_whole_number_from_1_and_keeps_the_last(argument, message):
    settings = ChatSettings(max_output_tokens=7)
    with pytest.raises(ValueError) as raised:
        settings.run_command(f"/max {argument}")
    assert str(raised.value) == message
    assert settings.max_output_tokens == 7


def test_max_alone_leaves_it_to_the_server():
    settings = ChatSettings(max_output_tokens=7)
    assert settings.run_command("/max") == "max tokens: the server's"
    assert settings.max_output_tokens is None


@pytest.mark.parametrize("line", ["/bogus", "/TEMP 1", "/temperature 1", "/ temp 1", "/systems x"])
def test_an_unknown_command_is_refused_naming_it(line):
    settings = ChatSettings()
    with pytest.raises(ValueError) as raised:
        settings.run_command(line)
    assert str(raised.value) == f"unknown command {line.split()[0]} (/help lists them)"
    assert settings == ChatSettings()


def test_the_create_fields_are_those_set():
    assert ChatSettings().create_fields() == {}
    settings = ChatSettings(instructions="be brief", temperature=0.0, max_output_tokens=3, previous_response_id="r")
    assert settings.create_fields() == {"instructions": "be brief", "temperature": 0.0, "max_output_tokens": 3,
                                        "previous_response_id": "r"}
