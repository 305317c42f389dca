"""Run a GPU benchmark script's `--dry-run` (tiny shapes in Triton's interpreter, no timing) as gpu_check.sh's
sections would run it, and check that gpu_check.sh still parses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_dry(script: str, out: Path) -> str:
    """scripts/`script` --dry-run --out `out`; asserts it exits 0 and gpu_check.sh parses; returns the rows
    it wrote."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--dry-run", "--out", str(out)],
                            cwd=ROOT / "scripts", capture_output=True, text=True, timeout=300,
                            env=os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "scripts")})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    gpu_check = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert gpu_check.returncode == 0, gpu_check.stderr
    return out.read_text()
