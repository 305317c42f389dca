"""scripts/bench_image_ttft.py runs its whole path on a tiny Gemma 3 vision model (`--dry-run`): the cold case
encodes its picture once, the same request again reports cached tokens and encodes nothing, the same picture in
another conversation takes its embeddings from the cache (no encode) with fewer cached tokens, and the text-only
baseline has the cold case's prompt tokens and touches no image counter (sent again, it hits as many tokens as the
image request sent again)."""

from __future__ import annotations

from tests.helpers.bench_dry_run import run_dry


def rows(text: str) -> dict[str, list[str]]:
    """The table's rows by case number (`1`-`4`), the cells after the case's name."""
    table = [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()
             if line.startswith("| ") and line[2].isdigit()]
    return {row[0].split(".")[0]: row[1:] for row in table}


def test_image_ttft_benchmark_dry_run(tmp_path):
    cases = rows(run_dry("bench_image_ttft.py", tmp_path / "table.md"))
    assert sorted(cases) == ["1", "2", "3", "4", "5"]
    numbers = {case: [float(cell.replace(",", "").rstrip("x")) for cell in cells[:6]] + [cells[7], cells[8]]
               for case, cells in cases.items()}
    prompt = {case: values[0] for case, values in numbers.items()}
    assert len(set(prompt.values())) == 1 and prompt["1"] > 16  # one prompt length; the text one calibrated to it
    _, cold_cached, cold_encoded, cold_hits, cold_encoder_ms, cold_ttft, cold_ratio, _ = numbers["1"]
    assert cold_cached < 16 and cold_encoded == 1 and cold_hits == 0  # the new picture encoded once
    assert cold_encoder_ms >= 0 and cold_ttft > 0 and cold_ratio == "1.0x"
    _, again_cached, again_encoded, again_hits, again_encoder_ms, *_ = numbers["2"]
    assert again_cached == (prompt["2"] - 1) // 16 * 16 > 0  # every whole block but the last token's
    assert again_encoded == again_hits == 0 and again_encoder_ms == 0  # the image's tokens are all cached
    _, other_cached, other_encoded, other_hits, other_encoder_ms, *_ = numbers["3"]
    assert other_cached < again_cached and other_encoded == 0 and other_hits == 1 and other_encoder_ms == 0
    _, text_cached, text_encoded, text_hits, *_, text_ratio = numbers["4"]
    assert text_cached < 16 and text_encoded == text_hits == 0 and text_ratio == "1.00x"
    _, text_again_cached, text_again_encoded, text_again_hits, *_ = numbers["5"]
    assert text_again_cached == again_cached and text_again_encoded == text_again_hits == 0
