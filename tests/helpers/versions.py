"""The versions a test run used, printed in pytest's header so a failure elsewhere is traced to one."""

from __future__ import annotations

import platform
from importlib import metadata

# The distributions whose releases have changed what the suite sees: the model reference, the kernels'
# interpreter, the grammar engine, the three official SDKs and the transports.
REPORTED = ("torch", "transformers", "triton", "llguidance", "openai", "anthropic", "ollama", "textual",
            "websockets")


def versions_line() -> str:
    """`python 3.11.7 | torch 2.13.0+cpu | transformers 5.25.0 | ...`; `-` for one not installed."""
    parts = [f"python {platform.python_version()}"]
    for name in REPORTED:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} -")
    return "versions: " + " | ".join(parts)
