"""The kernel tests need Triton (Linux only); without it they are not collected."""

import importlib.util

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
