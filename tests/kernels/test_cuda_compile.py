"""Every kernel compiles for CUDA (to Triton's IR: where the errors that the interpreter lets through are
raised), with the arguments its wrapper passes; run in a process without TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_cuda():
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "cuda_compile.py"), "--frontend-only"],
                            env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert sum("_gemv_kernel" in line for line in compiled) >= 11  # every GGUF format
    assert sum("_token_gate_up_kernel" in line for line in compiled) >= 12  # dense and every GGUF format
    for kernel in ("_fused_kernel", "_dequantize_kernel", "_store_kv_kernel", "_paged_attention_kernel",
                   "_merge_splits_kernel", "_token_down_kernel", "_grouped_gate_up_kernel", "_grouped_down_kernel"):
        assert any(kernel in line for line in compiled), kernel
