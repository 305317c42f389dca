"""Compile every Triton kernel of the project for a CUDA target on a machine without a GPU.

Triton's interpreter runs kernel code as Python, so it accepts what the compiler refuses (a global that
is not a tl.constexpr, a shape that is not a compile-time constant); Triton ships ptxas, so the kernels
can be compiled to a cubin here. The host wrappers run on CPU tensors with the kernel launch replaced by
a recorder, so each kernel is compiled with the arguments and compile-time constants its wrapper really
passes (CUDA's tiling for the GGUF kernels; the model dtype for tl.dot operands, which the wrappers
choose by device), and the registers and spills of each are printed (`cuobjdump -res-usage`).

Without TRITON_INTERPRET: python tests/kernels/cuda_compile.py [--arch 90]
(about a minute on 2 cores). `--frontend-only` stops at Triton's IR, where the errors the interpreter
lets through are raised (a second for every kernel; tests/kernels/test_cuda_compile.py runs that).
Exits 1 if a kernel fails to compile.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int8: "*i8",
                 torch.uint8: "*u8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64"}
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Shared memory one block may use (the opt-in maximum) by compute capability: the 24 GB cards localserve
# is for (RTX 3090 sm_86, 4090 sm_89, 5090 sm_120) have 99 KiB; A100 163 KiB; H100 / H200 227 KiB.
SHARED_LIMITS = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 120: 101376}
LAUNCH_OPTIONS = ("num_warps", "num_stages")
TESTS = Path(__file__).resolve().parents[1]


def import_tests_package() -> None:
    """Make `tests.helpers` importable when this file runs as a script, without putting the repository root
    on sys.path (its kernels/, models/ and tui/ would hide the distributions of those names): the tests
    package is loaded from its file, as pytest's importlib mode and scripts/benchlib.py load it."""
    if "tests" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("tests", TESTS / "__init__.py",
                                                  submodule_search_locations=[str(TESTS)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tests"] = module
    spec.loader.exec_module(module)


def cuda_tools() -> Path | None:
    """The folder of Triton's bundled ptxas and cuobjdump, or None without them."""
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return folder if (folder / "ptxas").exists() and (folder / "cuobjdump").exists() else None


def record_launches(drive) -> list[tuple[JITFunction, dict, dict]]:
    """Run `drive()` with every kernel launch recorded instead of run: (kernel, its bound arguments, the
    launch options it passed: num_warps, num_stages)."""
    launches = []

    def record(kernel, *args, grid, warmup, **kwargs):
        options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
        bound = kernel.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        launches.append((kernel, dict(bound.arguments), options))

    original = JITFunction.run
    JITFunction.run = record
    try:
        drive()
    finally:
        JITFunction.run = original
    return launches


def compile_launch(kernel: JITFunction, arguments: dict, arch: int, model_dtype: torch.dtype,
                   frontend_only: bool = False, options: dict | None = None):
    """triton.compile the kernel for sm_`arch` with these arguments' types and constants, the tl.dot
    operand dtype set to what a CUDA device gets (`model_dtype`); -> (the compiled kernel, or None when
    `frontend_only` stopped at Triton's IR, and the constants)."""
    signature, constants, attributes = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = arguments[param.name]
        if param.is_constexpr:
            if param.name == "COMPUTE" and value == tl.float32 and model_dtype in TL_DTYPES:
                value = TL_DTYPES[model_dtype]
            if param.name == "DOT_PRECISION" and model_dtype in TL_DTYPES:
                value = "tf32"
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attributes[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and value != 0:
                attributes[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    source = ASTSource(kernel, signature=signature, constexprs=constants, attrs=attributes)
    target = GPUTarget("cuda", arch, 32)
    if frontend_only:
        try:
            from triton._C.libtriton import ir
            from triton.compiler.compiler import make_backend

            backend = make_backend(target)
            options = backend.parse_options(options or {})
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            make_ir = source.make_ir
        except (ImportError, AttributeError):  # another Triton's internals: compile it all instead
            pass
        else:
            make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
            return None, constants
    return triton.compile(source, target=target, options=options or None), constants


def resource_usage(compiled, tools: Path) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([tools / "cuobjdump", "-res-usage", cubin.name], capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", report, re.S)
    return f"registers {match.group(1)}, stack {match.group(2)}, local {match.group(3)}" if match else "?"


def drive_gguf(dtype: torch.dtype) -> None:
    """Every GGUF format's gemv, and one format's every kernel, with CUDA's tiling."""
    from localserve.kernels.gguf_blocks import QUANT_FORMATS
    from localserve.kernels.gguf_matmul import CUDA, dequantize_rows, quantized_matmul

    for name, fmt in QUANT_FORMATS.items():
        in_features = 4 * 256
        blocks = torch.zeros(48, fmt.row_bytes(in_features), dtype=torch.uint8)
        x = torch.zeros(17, in_features, dtype=dtype)
        quantized_matmul(x[:1], blocks, fmt, in_features, method="gemv", config=CUDA)
        if name == "Q4_K":
            quantized_matmul(x[:4], blocks, fmt, in_features, method="gemv", config=CUDA)
            quantized_matmul(x, blocks, fmt, in_features, method="fused", config=CUDA)
            dequantize_rows(blocks, fmt, in_features, dtype, rows=torch.arange(3), config=CUDA)


def drive_moe(dtype: torch.dtype, arch: int) -> None:
    """fused_moe's four kernels for dense experts in `dtype` and for every GGUF format, with the tiling of a
    CUDA device of sm_`arch`, in Qwen3-30B-A3B's shapes (hidden 2048, expert intermediate 768); the grouped
    ones at their largest run of pairs."""
    from localserve.kernels.fused_moe import cuda_moe_config, fused_moe
    from localserve.kernels.gguf_blocks import QUANT_FORMATS
    from localserve.kernels.moe_experts import ExpertMatrix, Experts

    num_experts, hidden, intermediate = 4, 2048, 768
    for fmt in [None, *QUANT_FORMATS.values()]:
        def matrix(rows: int, columns: int, fmt=fmt) -> ExpertMatrix:
            if fmt is None:
                return ExpertMatrix(torch.zeros(num_experts, rows, columns, dtype=dtype), columns)
            return ExpertMatrix(torch.zeros(num_experts, rows, fmt.row_bytes(columns), dtype=torch.uint8), columns,
                                fmt)

        experts = Experts(matrix(intermediate, hidden), matrix(intermediate, hidden), matrix(hidden, intermediate))
        config = cuda_moe_config(arch // 10)
        for num_tokens, method in ((1, "per_token"), (config.max_block_m * num_experts // 2, "grouped")):
            ids = torch.arange(2 * num_tokens).reshape(num_tokens, 2) % num_experts
            fused_moe(torch.zeros(num_tokens, hidden, dtype=dtype), experts, ids, torch.ones(num_tokens, 2),
                      method=method, config=config)


def drive_attention(dtype: torch.dtype, largest_only: bool = False) -> None:
    """store_kv and paged_attention (split and not) for every KV format the kernels read."""
    from localserve.attention.triton_backend import TritonAttentionBackend

    import_tests_package()
    from tests.helpers.kv_pools import fill_batch

    plain = "bf16" if dtype != torch.float32 else "fp32"
    formats = [(plain, plain, 1), ("q8_0", "q4_rot", 4), ("q4_rot", "q8_0", 1), ("q4_rot", "q4_rot", 1)]
    batches = [[(1, 40), (5, 18)], [(1, 40), (1, 18)]]  # prefill tiles (64 rows), decode (16)
    if largest_only:  # the cases that need the most shared memory
        formats, batches = [formats[0], formats[-1]], batches[:1]
    for k_type, v_type, splits in formats:
        for shapes in batches:
            batch = fill_batch(shapes, k_type, v_type, 8, 2, 128, dtype)
            backend = TritonAttentionBackend(num_splits=splits)
            backend.forward(0, batch.query, batch.key, batch.value, batch.cache,
                            backend.build_metadata(batch.inputs))


def drive_attention_geometry(dtype: torch.dtype, largest_only: bool = False, four_bit_only: bool = False) -> None:
    """The per-layer geometries of issue 36: gpt-oss's window 128 with sinks split (the merge adds the sinks),
    a soft-cap, head sizes 256 and 512 (Gemma 4: its 512 layers with keys as values) in 16-bit, q8_0 and
    4-bit stores, for prefill tiles and decodes."""
    from localserve.attention.base import AttentionGeometry
    from localserve.attention.triton_backend import TritonAttentionBackend

    import_tests_package()
    from tests.helpers.geometry_pools import geometry_batch

    plain = "bf16" if dtype != torch.float32 else "fp32"
    sinks = torch.zeros(8)
    cases = [  # (geometry, K format, V format, splits)
        (AttentionGeometry(8, 1, 64, 0.125, 128, sinks), plain, plain, 4),
        (AttentionGeometry(8, 2, 128, 0.1, 64, None, 50.0), "q8_0", "q4_rot", 1),
        (AttentionGeometry(8, 2, 256, 0.1, 64), plain, plain, 1),
        (AttentionGeometry(8, 2, 256, 0.1, 64, sinks), "q4_rot", "q4_rot", 2),
        (AttentionGeometry(8, 1, 512, 0.1, keys_are_values=True), plain, plain, 1),
        (AttentionGeometry(8, 1, 512, 0.1, keys_are_values=True), "q8_0", "q8_0", 2),
        (AttentionGeometry(8, 1, 512, 0.1, keys_are_values=True), "q4_rot", "q4_rot", 1),
    ]
    batches = [[(1, 40), (5, 18)], [(1, 40), (1, 18)]]  # prefill tiles, decode
    if largest_only:
        cases, batches = [cases[3], cases[6]], batches[:1]
    if four_bit_only:  # the cases whose registers are tightest
        cases = [case for case in cases if "q4_rot" in case[1:3]]
    for geometry, k_type, v_type, splits in cases:
        for shapes in batches:
            batch = geometry_batch(shapes, geometry, k_type, v_type, dtype)
            backend = TritonAttentionBackend(num_splits=splits)
            backend.forward(0, batch.query, batch.key, batch.value, batch.cache,
                            backend.build_metadata(batch.inputs), geometry)


def drive_delta(dtype: torch.dtype) -> None:
    """The gated delta rule's fused recurrent kernel over state slots in Qwen3.6-35B-A3B's shapes (16 key heads,
    32 value heads, Dk = Dv = 128): decode at batch 1 and 64 (its two value-block widths), with and without
    the L2 norm of q and k, and several tokens per sequence."""
    from localserve.kernels.gated_delta import fused_recurrent_slots

    k_heads, v_heads, dim = 16, 32, 128
    states = torch.zeros(4, v_heads, dim, dim)
    for num_seqs, length, l2norm in ((1, 1, True), (64, 1, True), (64, 1, False), (2, 7, True)):
        q, k = (torch.zeros(num_seqs, length, k_heads, dim, dtype=dtype) for _ in range(2))
        v = torch.zeros(num_seqs, length, v_heads, dim, dtype=dtype)
        g, beta = torch.zeros(num_seqs, length, v_heads), torch.zeros(num_seqs, length, v_heads, dtype=dtype)
        slots = torch.zeros(num_seqs, dtype=torch.int64)
        fused_recurrent_slots(q, k, v, g, beta, states, slots, slots, l2norm_qk=l2norm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 89, 90")
    parser.add_argument("--only", choices=("gguf", "moe", "attention", "attention-largest", "attention-geometry",
                                           "attention-geometry-largest", "attention-geometry-4bit", "delta"),
                        help="one family of kernels; attention-largest: the attention kernels that need the most "
                             "shared memory (prefill tiles, 16-bit and 4-bit stores, bf16 and fp32 models); "
                             "attention-geometry: windows, sinks, soft-caps, head sizes 256 / 512, keys as "
                             "values (-largest: the 4-bit head size 256 and 512 prefill tiles; -4bit: every case "
                             "with a 4-bit store); delta: the gated delta rule's recurrent kernel")
    parser.add_argument("--frontend-only", action="store_true", help="stop at Triton's IR (no ptxas, no usage)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    tools = cuda_tools()
    if tools is None and not args.frontend_only:
        sys.exit("this Triton has no bundled ptxas / cuobjdump (--frontend-only needs neither)")
    launches = []
    if args.only in (None, "gguf"):
        launches += [(launch, torch.bfloat16) for launch in record_launches(lambda: drive_gguf(torch.bfloat16))]
    if args.only in (None, "moe"):
        launches += [(launch, torch.bfloat16) for launch in
                     record_launches(lambda: drive_moe(torch.bfloat16, args.arch))]
    if args.only in (None, "attention", "attention-largest"):
        largest = args.only == "attention-largest"
        for dtype in (torch.bfloat16, torch.float32):
            launches += [(launch, dtype) for launch in
                         record_launches(lambda dtype=dtype: drive_attention(dtype, largest))]
    if args.only in (None, "attention-geometry", "attention-geometry-largest", "attention-geometry-4bit"):
        largest, four_bit = args.only == "attention-geometry-largest", args.only == "attention-geometry-4bit"
        for dtype in (torch.bfloat16, torch.float32):
            launches += [(launch, dtype) for launch in
                         record_launches(lambda dtype=dtype: drive_attention_geometry(dtype, largest, four_bit))]
    if args.only in (None, "delta"):
        for dtype in (torch.bfloat16, torch.float32):
            launches += [(launch, dtype) for launch in record_launches(lambda dtype=dtype: drive_delta(dtype))]
    limit = SHARED_LIMITS.get(args.arch)
    failures, seen = 0, set()
    for (kernel, arguments, options), dtype in launches:
        constants = {}
        try:
            compiled, constants = compile_launch(kernel, arguments, args.arch, dtype, args.frontend_only, options)
            shared = None if compiled is None else compiled.metadata.shared
            if shared is not None and limit is not None and shared > limit:
                raise RuntimeError(f"needs {shared:,} B of shared memory, sm_{args.arch} has {limit:,}")
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the exit code says so
            failures += 1
            shown = ", ".join(f"{k}={v}" for k, v in constants.items() if k not in ("COMPUTE", "DOT_PRECISION"))
            print(f"FAILED {kernel.__name__} [{dtype}, {shown}]: {type(exc).__name__}: {str(exc)[-2000:]}")
            continue
        shown = ", ".join(f"{k}={v}" for k, v in constants.items() if k not in ("COMPUTE", "DOT_PRECISION"))
        shown = f"{str(dtype).removeprefix('torch.')}, {shown}{''.join(f', {k}={v}' for k, v in options.items())}"
        if (kernel.__name__, shown) not in seen:
            seen.add((kernel.__name__, shown))
            usage = ("to Triton's IR" if compiled is None
                     else f"{resource_usage(compiled, tools)}, shared {compiled.metadata.shared:,} B")
            print(f"ok {kernel.__name__} [{shown}]: {usage}", flush=True)
    print(f"{len(seen)} kernels compiled for sm_{args.arch}, {failures} failed")
    return 1 if failures else 0

if __name__ == "__main__":
    sys.exit(main())
