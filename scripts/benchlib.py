"""Shared by the benchmark scripts: the machine they ran on, percentiles, raw results next to the plots."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "bench"


def import_test_helpers() -> None:
    """Makes `tests.helpers` importable without putting the repository root on sys.path, where `kernels/`,
    `models/` and `tui/` would hide the distributions of those names (transformers imports Hugging Face's
    `kernels`): the tests package is loaded from its file, as pytest's importlib mode loads it."""
    if "tests" in sys.modules:
        return
    folder = ROOT / "tests"
    spec = importlib.util.spec_from_file_location("tests", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tests"] = module
    spec.loader.exec_module(module)


def machine() -> dict[str, Any]:
    """CPU model, cores, torch threads and versions: printed by every benchmark and saved with its numbers."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    return info


def print_machine(info: dict[str, Any]) -> None:
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} with {info['torch_threads']} "
          f"threads{', ' + info['cuda'] if info['cuda'] else ''}; {info['date']}")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def save_raw(name: str, info: dict[str, Any], results: Any) -> Path:
    """Write docs/bench/NAME.json with the machine and the raw numbers, so a later run can be compared."""
    DOCS.mkdir(parents=True, exist_ok=True)
    path = DOCS / f"{name}.json"
    path.write_text(json.dumps({"machine": info, "results": results}, indent=1) + "\n")
    return path


def row_emitter(out: Path | None) -> Callable[[list[str]], None]:
    """emit(lines): print each line, and append it to `out` too, at once, so a run stopped by a time limit
    keeps what it measured."""
    handle = out.open("w") if out else None

    def emit(lines: list[str]) -> None:
        for line in lines:
            print(line, flush=True)
            if handle:
                print(line, file=handle, flush=True)

    return emit


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def bar_chart(path: Path, title: str, categories: list[str], series: dict[str, list[float]], ylabel: str,
              log: bool = False) -> Path:
    """Grouped bars (one group per category, one bar per series) saved as a PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axis = plt.subplots(figsize=(max(6.0, 1.1 * len(categories) * len(series)), 4))
    x = np.arange(len(categories))
    width = 0.8 / len(series)
    for index, (name, values) in enumerate(series.items()):
        bars = axis.bar(x + (index - (len(series) - 1) / 2) * width, values, width, label=name)
        axis.bar_label(bars, fmt="%.3g", fontsize=7)
    long_labels = max(len(c) for c in categories) > 10
    axis.set_xticks(x, categories, rotation=30 if long_labels else 0, ha="right" if long_labels else "center")
    axis.set_ylabel(ylabel)
    if log:
        axis.set_yscale("log")
    axis.set_title(title)
    if len(series) > 1:
        axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
