"""The browser tests' set-up: Debian's Chromium (installed here when it is missing and we are root; the
tests skip, saying why, when it cannot be), driven by Playwright for Python, never a browser download.

`browser` is one headless Chromium for a module, launched with the flags that work in this sandbox
(no GPU, no QUIC, no background traffic); every test gets a fresh context (`page`: its own profile
storage, cookies, localStorage) with its console messages and page errors recorded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL_TIMEOUT_S = 900


def ensure_chromium() -> str | None:
    """The path of Debian's Chromium, installed with apt-get when it is missing; None (with the reason
    printed) when it cannot be."""
    if os.path.exists(CHROMIUM):
        return None
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return f"{CHROMIUM} is missing and only root can install it (apt-get install -y chromium)"
    if shutil.which("apt-get") is None:
        return f"{CHROMIUM} is missing and there is no apt-get to install it"
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if result.returncode != 0:
            return f"{' '.join(command)} failed: {result.stderr.strip()[-500:]}"
    return None if os.path.exists(CHROMIUM) else f"apt-get installed chromium, yet {CHROMIUM} is missing"


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for a module's browser tests. Module-scoped, not session-scoped: while
    Playwright's sync API is started, its event loop is the thread's running loop, and any other test's
    asyncio.run() would fail."""
    reason = ensure_chromium()
    if reason is not None:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # Playwright gives each launch a fresh temporary user-data directory, removed on close.
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class PageLog:
    """What a page said: console messages (type, text) and uncaught errors."""

    console: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def console_errors(self) -> list[str]:
        return [text for kind, text in self.console if kind == "error"] + self.errors


@pytest.fixture
def page(browser):
    """A page in a fresh context, 1400x900, its console recorded in `page.log` (a PageLog)."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(20_000)
    new_page = context.new_page()
    new_page.log = PageLog()
    new_page.on("console", lambda message: new_page.log.console.append((message.type, message.text)))
    new_page.on("pageerror", lambda error: new_page.log.errors.append(str(error)))
    try:
        yield new_page
    finally:
        context.close()


def slowed(llm, step_delay_s: float):
    """`llm`'s engine with each step taking `step_delay_s` longer (a reply long enough to watch and stop)."""
    engine = llm.engine
    step = engine.step

    def slow_step():
        time.sleep(step_delay_s)
        return step()

    engine.step = slow_step
    return llm


def write_chat_template(folder: Path) -> Path:
    """Give a scripted model (tests/helpers/scripted.py) a chat template whose prompt ends with its EOS,
    so that its reply is its script, whatever the messages."""
    import json

    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for message in messages %}{{ message['content'] }}{% endfor %}</s>"
    config_path.write_text(json.dumps(config))
    return folder
