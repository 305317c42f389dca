"""`localserve serve --no-webui` turns the page off; it is on by default."""

from __future__ import annotations

from localserve.cli import build_parser, server_config


def test_no_webui_turns_the_page_off():
    assert server_config(build_parser().parse_args(["serve"])).web_ui is True
    assert server_config(build_parser().parse_args(["serve", "--no-webui"])).web_ui is False
