"""Debian's Chromium for the browser tests and scripts (installed when it is missing and we are root),
the flags that work in this sandbox (no GPU, no QUIC, no background traffic), a page's console record,
and servers shaped for the page (steps slowed, a scripted model with a chat template)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class PageLog:
    """What a page said: console messages (type, text) and uncaught errors."""

    console: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def console_errors(self) -> list[str]:
        return [text for kind, text in self.console if kind == "error"] + self.errors


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
