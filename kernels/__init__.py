"""Triton kernels of the GPU path: quantize-on-write into the paged KV pool and paged attention.

Triton has no CPU backend, so on a machine without CUDA these kernels can only run in Triton's
interpreter; it is switched on here unless TRITON_INTERPRET is set. That must happen before triton is
first imported (its own library functions are decorated then), so import this package before triton.
The engine's CPU path never comes here (it uses the plain-torch attention backend); the tests do.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
