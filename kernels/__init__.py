"""Triton kernels of the GPU path: quantize-on-write into the paged KV pool and paged attention.

Triton has no CPU backend: without CUDA these kernels run only in Triton's interpreter, which has to be
chosen (TRITON_INTERPRET=1) before triton is first imported; the tests do that in tests/conftest.py.
"""
