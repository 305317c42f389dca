"""scripts/bench_window_attention.py (gpu_check.sh's window section) runs its path without a GPU: tiny shapes in
Triton's interpreter, the kernel's own tile counts flat in the context for a window layer."""

from __future__ import annotations

from tests.helpers.bench_dry_run import run_dry


def test_window_benchmark_dry_run(tmp_path):
    text = run_dry("bench_window_attention.py", tmp_path / "rows.md")
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| window 32")]
    tiles = {(row[1].strip(), row[2].strip()): int(row[8]) for row in rows}  # (layer, context): tiles visited
    assert tiles[("window 32, sinks", "256")] == tiles[("window 32, sinks", "1,024")] == 1
    assert tiles[("window 32, sinks (no window)", "1,024")] == 16
