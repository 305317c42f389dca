"""scripts/bench_window_attention.py (gpu_check.sh's window section) runs its path without a GPU: tiny shapes in
Triton's interpreter, the kernel's own tile counts flat in the context for a window layer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_window_benchmark_dry_run(tmp_path):
    out = tmp_path / "rows.md"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_window_attention.py"), "--dry-run",
                             "--out", str(out)], cwd=ROOT / "scripts", capture_output=True, text=True, timeout=300,
                            env=os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "scripts")})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith("| window 32")]
    tiles = {(row[1].strip(), row[2].strip()): int(row[8]) for row in rows}  # (layer, context): tiles visited
    assert tiles[("window 32, sinks", "256")] == tiles[("window 32, sinks", "1,024")] == 1
    assert tiles[("window 32, sinks (no window)", "1,024")] == 16
    gpu_check = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert gpu_check.returncode == 0, gpu_check.stderr
