"""Driving the web page in the browser tests: its API fetched from Python, a message sent, a reply awaited."""

from __future__ import annotations

import json
import urllib.request


def get_json(port: int, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def open_page(page, port: int):
    page.goto(f"http://127.0.0.1:{port}/")
    page.wait_for_selector("body[data-ready=true]")
    return page


def set_settings(page, values: dict[str, str]) -> None:
    if page.get_attribute("#settings", "open") is None:
        page.click("#settings summary")
    for name, value in values.items():
        page.fill(f"#settings-fields [name={name}]", value)


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_reply(page):
    return page.locator(".message.assistant").last


def wait_reply_done(page) -> None:
    page.wait_for_selector(".message.assistant:last-child .meta .regenerate")
