"""scripts/bench_delta_rule.py (gpu_check.sh's delta section) runs its path without a GPU: tiny shapes in
Triton's interpreter, every kernel checked against torch, and gpu_check.sh still parses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_delta_rule_benchmark_dry_run(tmp_path):
    out = tmp_path / "rows.md"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_delta_rule.py"), "--dry-run",
                             "--out", str(out)], cwd=ROOT / "scripts", capture_output=True, text=True, timeout=300,
                            env=os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "scripts")})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    text = out.read_text()
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ")]
    assert {(batch.strip(), backend.strip()) for batch, backend in rows} >= {("1", "torch"), ("3", "triton")}
    assert "| torch chunked |" in text and "| Triton recurrent |" in text
    assert "Every kernel agreed with torch" in text
    gpu_check = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert gpu_check.returncode == 0, gpu_check.stderr
