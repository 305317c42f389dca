"""Registers the shared helpers (tests/helpers) as a plugin: their fixtures are visible to every test."""

import os

import torch

# Without CUDA the Triton kernels can only run in Triton's interpreter, and that has to be chosen before
# triton is first imported: its own library functions (tl.cdiv, ...) are decorated at import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["tests.helpers"]
