"""scripts/bench_hybrid_speculation.py runs its whole path on a tiny model (`--dry-run`): every row answers
as without drafts, drafts without planted mistakes are all kept, and planted ones are rejected."""

from __future__ import annotations

from tests.helpers.bench_dry_run import run_dry


def test_hybrid_speculation_benchmark_dry_run(tmp_path):
    text = run_dry("bench_hybrid_speculation.py", tmp_path / "table.md")
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [(row[0], row[1]) for row in rows] == [("1", "0%"), ("1", "50%"), ("2", "0%"), ("2", "50%")]
    for batch, wrong, _, _, _, kept, per_verify, settle_share, same in rows:
        assert same == "yes"
        assert float(per_verify) > 1 and 0 < float(settle_share.rstrip("%")) < 100
        assert (kept == "100%") == (wrong == "0%"), (batch, wrong, kept)
