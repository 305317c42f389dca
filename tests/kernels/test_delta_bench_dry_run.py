"""scripts/bench_delta_rule.py (gpu_check.sh's delta section) runs its path without a GPU: tiny shapes in
Triton's interpreter, every kernel checked against torch, and gpu_check.sh still parses."""

from __future__ import annotations

from tests.helpers.bench_dry_run import run_dry


def test_delta_rule_benchmark_dry_run(tmp_path):
    text = run_dry("bench_delta_rule.py", tmp_path / "rows.md")
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ")]
    assert {(batch.strip(), backend.strip()) for batch, backend in rows} >= {("1", "torch"), ("3", "triton")}
    assert "| torch chunked |" in text and "| Triton recurrent |" in text
    assert "Every kernel agreed with torch" in text
