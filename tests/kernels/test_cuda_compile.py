"""Every kernel compiles for CUDA (to Triton's IR: where the errors that the interpreter lets through are
raised), with the arguments its wrapper passes; run in a process without TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compile_check(*args: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "cuda_compile.py"), *args],
                            env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_every_kernel_compiles_for_cuda():
    result = compile_check("--frontend-only")
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert sum("_gemv_kernel" in line for line in compiled) >= 11  # every GGUF format
    assert sum("_token_gate_up_kernel" in line for line in compiled) >= 12  # dense and every GGUF format
    for kernel in ("_fused_kernel", "_dequantize_kernel", "_store_kv_kernel", "_paged_attention_kernel",
                   "_merge_splits_kernel", "_token_down_kernel", "_grouped_gate_up_kernel", "_grouped_down_kernel"):
        assert any(kernel in line for line in compiled), kernel


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_attention_fits_the_shared_memory_of_a_24_gb_card():
    """An H200 refused an fp32 model's 4-bit prefill tile (278,784 B of shared memory, 232,448 allowed);
    consumer cards (sm_86 / 89 / 120) allow 101,376 B. The largest tiles, compiled to a cubin for sm_86."""
    result = compile_check("--only", "attention-largest", "--arch", "86")
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok _paged_attention_kernel")]
    assert len(compiled) == 4 and all("shared" in line for line in compiled), result.stdout


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_head_sizes_256_and_512_fit_the_shared_memory_of_a_24_gb_card():
    """Gemma 4's head sizes in 4-bit stores (256: window layers, the most shared memory of the geometry
    kernels; 512: keys-as-values global layers), prefill tiles, bf16 and fp32 models, compiled to a cubin
    for sm_86 (101,376 B a block); a bf16 model's head size 512 without spills."""
    result = compile_check("--only", "attention-geometry-largest", "--arch", "86")
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok _paged_attention_kernel")]
    assert len(compiled) == 4 and all("shared" in line for line in compiled), result.stdout
    assert all("stack 0," in line for line in compiled if "HEAD_DIM=512" in line and "[bfloat16" in line), result.stdout


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_attention_with_4_bit_stores_does_not_spill_on_sm_90():
    """ptxas for sm_90 spilled 6.5 KB of a 4-bit head-size-256 prefill tile (the key mean's [rows, D] x
    [D, keys] fp32 product) and 648 B of its decode tile; an fp32 model's 64-row tiles spilled 216-568 B
    until the plan capped their rows (paged_attention.prefill_rows_cap). The geometry kernels with a 4-bit
    store (head sizes 128, 256, 512; prefill and decode tiles) of a bf16 and an fp32 model, compiled to a
    cubin for sm_90: no stack. (`_store_kv_kernel` is not checked here: its rotation and level search
    still spill, 648-1,744 B.)"""
    result = compile_check("--only", "attention-geometry-4bit", "--arch", "90")
    compiled = [line for line in result.stdout.splitlines()
                if line.startswith(("ok _paged_attention_kernel", "ok _merge_splits_kernel"))]
    # 5 bf16 and 4 fp32 tiles (head 512, and an fp32 model's head 256: prefill tile = decode tile), 2 merges
    assert len(compiled) == 11, result.stdout
    spilled = [line for line in compiled if "stack 0," not in line]
    assert not spilled, "\n".join(spilled)
