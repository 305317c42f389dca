"""The command line loads bfloat16 where it is the fast type (a GPU, a CPU with bf16 instructions) and
float32 elsewhere; the library keeps float32 on a CPU as the exact reference."""

from __future__ import annotations

import pytest
import torch

from localserve import cli
from localserve.loading import hf

X86_WITH = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\nmodel name\t: AMD EPYC\n"
X86_WITHOUT = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
ARM_WITH = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(("cpuinfo", "expected"), [(X86_WITH, True), (X86_WITHOUT, False), (ARM_WITH, True),
                                                   ("processor\t: 0\n", False), ("", False),
                                                   ("flags\t: avx512_bf16x\n", False)])
def test_bf16_instructions_read_from_cpuinfo(cpuinfo, expected):
    assert hf.has_bf16_instructions(cpuinfo) is expected


@pytest.mark.parametrize(("device", "has_bf16", "expected"), [
    ("cpu", True, torch.bfloat16), ("cpu", False, torch.float32), ("cuda", False, torch.bfloat16)])
def test_serving_dtype_by_device_and_cpu(monkeypatch, device, has_bf16, expected):
    monkeypatch.setattr(hf, "cpu_multiplies_bf16", lambda: has_bf16)
    assert hf.serving_dtype(device) == expected
    assert hf.default_dtype(device) == (torch.float32 if device == "cpu" else torch.bfloat16)


@pytest.mark.parametrize(("flags", "has_bf16", "expected"), [
    ([], True, torch.bfloat16), ([], False, torch.float32), (["--dtype", "float32"], True, torch.float32),
    (["--dtype", "float16"], False, torch.float16)])
def test_command_line_passes_the_serving_dtype_unless_told(monkeypatch, flags, has_bf16, expected):
    monkeypatch.setattr(hf, "cpu_multiplies_bf16", lambda: has_bf16)
    seen = {}

    class FakeLLM:
        def __init__(self, model, *, dtype, device, **kwargs):
            seen.update(dtype=dtype, device=device)

    monkeypatch.setattr("localserve.llm.LLM", FakeLLM)
    args = cli.build_parser().parse_args(["generate", "--device", "cpu", *flags, "hello"])
    cli.build_llm(args, cli.engine_config(args))
    assert seen == {"dtype": expected, "device": "cpu"}
