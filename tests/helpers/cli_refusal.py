"""The real CLI in a subprocess, for the checks that it refuses bad arguments at once: under a short timeout (a
CLI that opened the model, or loaded it, runs past it) and with `-X importtime`, whose table on stderr lists
every module the process imported."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

TIMEOUT_S = 2.0


def run_cli(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m localserve.cli *args`'s result and its seconds; fails the test past TIMEOUT_S."""
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-X", "importtime", "-m", "localserve.cli", *args],
                                capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"localserve {' '.join(args)} ran past {TIMEOUT_S} s (it opened the model, or loaded it)")
    return result, time.monotonic() - start


def refusal(result: subprocess.CompletedProcess) -> str:
    """The error lines of stderr (without the import-time table)."""
    return "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))


def imported_modules(result: subprocess.CompletedProcess) -> set[str]:
    """Every module the process imported, from the import-time table."""
    return {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
