"""scripts/bench_state_reuse.py runs its whole path on a tiny model (`--dry-run`): both tables, every turn
answered alike with the cache on and off, the cached tokens on block boundaries, and a shorter checkpoint
interval never recomputing more."""

from __future__ import annotations

from tests.helpers.bench_dry_run import run_dry


def cells(text: str, first: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith(f"| {first}")]


def test_state_reuse_benchmark_dry_run(tmp_path):
    text = run_dry("bench_state_reuse.py", tmp_path / "tables.md")
    turns = [row for row in cells(text, "") if row[0].isdigit() and len(row) == 8]
    assert [row[0] for row in turns] == ["1", "2", "3"]
    for _, prompt, cached, prefilled, *_, same in turns:
        prompt, cached, prefilled = (int(value.replace(",", "")) for value in (prompt, cached, prefilled))
        assert cached % 16 == 0 and cached < prompt and prefilled == prompt - cached
        assert same == "yes"
    assert turns[0][2] == "0"
    [total] = cells(text, "total")
    every_512, every_32 = int(total[2].replace(",", "")), int(total[3].replace(",", ""))
    assert every_32 <= every_512 < int(total[1].replace(",", ""))  # reuse prefilled less than the prompts
    assert cells(text, "checkpoints cached at the end") and cells(text, "their memory (MiB)")
