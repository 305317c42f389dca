"""The CUDA-graph decode path runs the Triton kernels (Linux only); without Triton its tests are not collected."""

import importlib.util

if importlib.util.find_spec("triton") is None:
    collect_ignore = ["test_cuda_graphs.py"]
