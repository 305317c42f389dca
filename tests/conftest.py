"""The test process's import path, the versions it runs with, and the shared helpers (tests/helpers) as a
plugin: their fixtures are visible to every test."""

import os
import sys
from pathlib import Path

# No folder of the repository may stand in for an installed distribution: `kernels/`, `models/` and `tui/`
# install as localserve.kernels, .models and .tui, while `kernels` is also Hugging Face's distribution,
# which transformers imports. pytest imports the tests with --import-mode=importlib (pyproject.toml), which
# leaves sys.path alone; `python -m pytest` still puts the current folder first, so that entry goes here,
# before anything else is imported. Child Pythons the tests start (`python -m localserve.cli`, `python -c`)
# would put their own current folder first in the same way: PYTHONSAFEPATH (Python 3.11+) keeps it out.
REPOSITORY = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != REPOSITORY]
os.environ["PYTHONSAFEPATH"] = "1"

# Triton's interpreter runs tl.dot through numpy: OpenBLAS's own threads, contending with torch's for the
# machine's two cores, made a 16 x 128 x 256 product take up to 27 ms instead of 50 us. Read when numpy
# loads (torch loads it).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA the Triton kernels can only run in Triton's interpreter, and that has to be chosen before
# triton is first imported: its own library functions (tl.cdiv, ...) are decorated at import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.register_assert_rewrite("tests.helpers")  # imported here first, before pytest_plugins loads it
from tests.helpers.versions import versions_line  # noqa: E402

pytest_plugins = ["tests.helpers"]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """The versions line opens the output, before pytest's own header (which `-q` hides)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(versions_line())
