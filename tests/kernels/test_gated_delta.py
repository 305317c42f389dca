"""The gated delta rule's CUDA path (localserve.kernels.gated_delta) against the torch recurrent form.

Our fused recurrent kernel over state slots runs here under Triton's interpreter (natively on CUDA where there
is one): generated shapes (lengths, Hv a multiple of Hk, Dk != Dv, dimensions that are not powers of two),
gates near 0 and very negative, beta near 0 and 1, with and without an initial state; slot reads (-1 =
zeros) and in-place writes. fla-core's chunked form runs only on CUDA (gpu-marked tests): its kernels do
not run under the interpreter. Every kernel compiles for sm_90 with no stack (spills), by ptxas.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.kernels.gated_delta import fused_recurrent_slots
from localserve.models.layers.gated_delta import (
    chunked_gated_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_slots,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def inputs(seed: int, num_seqs: int, length: int, k_heads: int, group: int, k_dim: int, v_dim: int,
           gate: str = "mixed", write: str = "mixed", dtype: torch.dtype = torch.float32):
    """q, k, v, g, beta for [N, T] tokens; gate: "open" (g near 0), "closed" (g very negative) or "mixed";
    write: beta near 0, near 1 or mixed."""
    generator = torch.Generator().manual_seed(seed)
    v_heads = k_heads * group

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    query, key = randn(num_seqs, length, k_heads, k_dim), randn(num_seqs, length, k_heads, k_dim)
    value = randn(num_seqs, length, v_heads, v_dim)
    uniform = torch.rand(num_seqs, length, v_heads, generator=generator)
    g = {"open": -1e-4 * uniform, "closed": -30.0 - 20.0 * uniform,
         "mixed": torch.nn.functional.logsigmoid(4 * randn(num_seqs, length, v_heads))}[gate]
    beta = {"zero": 1e-4 * uniform, "one": 1 - 1e-4 * uniform,
            "mixed": torch.rand(num_seqs, length, v_heads, generator=generator)}[write]
    return tuple(x.to(DEVICE, dtype if x is not g else torch.float32) for x in (query, key, value, g, beta))


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 2e-4) -> None:
    scale = expected.abs().max().item() + 1.0
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance * scale, rtol=tolerance)


# few distinct dimensions: each is a compile on CUDA (gpu_check.sh's delta section runs these natively)
@settings(max_examples=25, deadline=None)
@given(num_seqs=st.integers(1, 3), length=st.integers(1, 9), k_heads=st.integers(1, 2),
       group=st.sampled_from([1, 3]), k_dim=st.sampled_from([8, 12]), v_dim=st.sampled_from([8, 20]),
       gate=st.sampled_from(["open", "closed", "mixed"]), write=st.sampled_from(["zero", "one", "mixed"]),
       with_state=st.booleans(), l2norm=st.booleans(), seed=st.integers(0, 2**16))
def test_recurrent_kernel_equals_torch(num_seqs, length, k_heads, group, k_dim, v_dim, gate, write, with_state,
                                       l2norm, seed):
    query, key, value, g, beta = inputs(seed, num_seqs, length, k_heads, group, k_dim, v_dim, gate, write)
    state = (torch.randn(num_seqs, k_heads * group, k_dim, v_dim, generator=torch.Generator().manual_seed(seed))
             .to(DEVICE) if with_state else None)
    expected, expected_state = recurrent_gated_delta_rule(query, key, value, g, beta, state, l2norm_qk=l2norm,
                                                          backend="torch")
    output, final = recurrent_gated_delta_rule(query, key, value, g, beta, state, l2norm_qk=l2norm,
                                               backend="triton")
    close(output, expected)
    close(final, expected_state)
    assert final.dtype == torch.float32 and output.dtype == value.dtype


@settings(max_examples=15, deadline=None)
@given(num_seqs=st.integers(1, 4), length=st.integers(1, 3), group=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16), data=st.data())
def test_slots_read_and_write_the_pool_in_place(num_seqs, length, group, seed, data):
    """Each sequence reads its slot (or zeros) and writes another or the same; every other slot stays."""
    num_slots = 2 * num_seqs + 1
    order = data.draw(st.permutations(range(num_slots)))
    read = torch.tensor([order[i] if data.draw(st.booleans()) else -1 for i in range(num_seqs)])
    same = data.draw(st.booleans())
    write = torch.tensor([order[i] if same else order[num_seqs + i] for i in range(num_seqs)])
    query, key, value, g, beta = inputs(seed, num_seqs, length, 2, group, 8, 8)
    pool = torch.randn(num_slots, 2 * group, 8, 8, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    expected_pool = pool.clone()
    expected = recurrent_gated_delta_rule_slots(query, key, value, g, beta, expected_pool, read.to(DEVICE),
                                                write.to(DEVICE), l2norm_qk=True, backend="torch")
    output = recurrent_gated_delta_rule_slots(query, key, value, g, beta, pool, read.to(DEVICE), write.to(DEVICE),
                                              l2norm_qk=True, backend="triton")
    close(output, expected)
    close(pool, expected_pool)
    untouched = [s for s in range(num_slots) if s not in write.tolist()]
    torch.testing.assert_close(pool[untouched], expected_pool[untouched], atol=0, rtol=0)


def test_decode_step_by_step_equals_the_whole_sequence():
    """Decoding one token at a time through a slot (read = write) gives the recurrent form over all tokens."""
    query, key, value, g, beta = inputs(7, 2, 6, 2, 2, 16, 16)
    expected, expected_state = recurrent_gated_delta_rule(query, key, value, g, beta, l2norm_qk=True,
                                                          backend="torch")
    pool = torch.zeros(3, 4, 16, 16, device=DEVICE)
    slots = torch.tensor([2, 0], device=DEVICE)
    outputs = []
    for t in range(6):
        read = slots if t else torch.full_like(slots, -1)
        outputs.append(fused_recurrent_slots(*(x[:, t:t + 1] for x in (query, key, value, g, beta)), pool, read,
                                             slots, l2norm_qk=True))
    close(torch.cat(outputs, dim=1), expected)
    close(pool[slots], expected_state)


def test_decode_through_a_step_states_cache():
    """A decode step as a recurrent layer runs it on CUDA: the state cache's matrix tensor, the step's read
    slots and save slots straight into the kernel, in place; the same as StepStates.initial, the recurrent
    rule and StepStates.save (the torch path). A fresh sequence (-1), one moving its running slot forward in
    place, one writing a new slot."""
    from localserve.kv.recurrent_states import RecurrentStateCache, StepStates
    from localserve.kv.state_shape import StateShape

    shape = StateShape(conv_dim=3 * 16, conv_width=4, num_heads=4, key_dim=8, value_dim=8)
    caches = [RecurrentStateCache([5], shape, num_slots=6, dtype=torch.float32, device=DEVICE) for _ in range(2)]
    for cache in caches:
        cache.matrix[5].copy_(torch.randn(6, 4, 8, 8, generator=torch.Generator().manual_seed(0)))
    read, saves = torch.tensor([-1, 2, 4], device=DEVICE), [[(1, 1)], [(1, 2)], [(1, 0)]]
    query, key, value, g, beta = inputs(9, 3, 1, 2, 2, 8, 8)
    expected_states = StepStates(caches[0], read, saves)
    _, initial = expected_states.initial(5)
    expected, final = recurrent_gated_delta_rule(query, key, value, g, beta, initial, l2norm_qk=True,
                                                 backend="torch")
    expected_states.save(5, expected_states.save_slots(), torch.zeros(3, 48, 3), final)
    states = StepStates(caches[1], read, saves)
    output = recurrent_gated_delta_rule_slots(query, key, value, g, beta, states.cache.matrix[5], states.read_slots,
                                              states.save_slots(), l2norm_qk=True, backend="triton")
    close(output, expected)
    close(caches[1].matrix[5], caches[0].matrix[5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    """16-bit q/k/v/beta: the kernel computes in fp32, the output in the value's dtype, the state fp32."""
    query, key, value, g, beta = inputs(3, 2, 4, 1, 2, 16, 16, dtype=dtype)
    expected, expected_state = recurrent_gated_delta_rule(query, key, value, g, beta, l2norm_qk=True,
                                                          backend="torch")
    output, final = recurrent_gated_delta_rule(query, key, value, g, beta, l2norm_qk=True, backend="triton")
    assert output.dtype == dtype and final.dtype == torch.float32
    close(output, expected, 1e-2)
    close(final, expected_state, 1e-4)


def test_strided_inputs_as_a_projection_splits_them():
    """q, k and v as views into one projection's output (rows strided by the whole projection)."""
    num_seqs, length, heads, dim = 2, 3, 2, 8
    mixed = torch.randn(num_seqs, length, 4 * heads * dim, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    query, key = (mixed[..., i * heads * dim:(i + 1) * heads * dim].unflatten(-1, (heads, dim)) for i in range(2))
    value = mixed[..., 2 * heads * dim:].unflatten(-1, (2 * heads, dim))
    g = -torch.rand(num_seqs, length, 2 * heads, device=DEVICE)
    beta = torch.rand(num_seqs, length, 2 * heads, device=DEVICE)
    expected, _ = recurrent_gated_delta_rule(query, key, value, g, beta, backend="torch")
    output, _ = recurrent_gated_delta_rule(query, key, value, g, beta, backend="triton")
    close(output, expected)


def test_bad_inputs_name_what_is_wrong():
    query, key, value, g, beta = inputs(1, 2, 1, 2, 2, 8, 8)
    pool = torch.zeros(4, 4, 8, 8, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="states must be"):
        fused_recurrent_slots(query, key, value, g, beta, pool[:, :2], slots, slots)
    with pytest.raises(ValueError, match="states must be contiguous"):
        fused_recurrent_slots(query, key, value, g, beta, pool.transpose(2, 3), slots, slots)
    with pytest.raises(ValueError, match="write_slots"):
        fused_recurrent_slots(query, key, value, g, beta, pool, slots, slots[:1])
    with pytest.raises(ValueError, match="read_slots"):
        fused_recurrent_slots(query, key, value, g, beta, pool, slots.float(), slots)
    with pytest.raises(ValueError, match="multiple of query/key heads"):
        fused_recurrent_slots(query, key, value[:, :, :3], g[:, :, :3], beta[:, :, :3], pool[:, :3], slots, slots)
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        fused_recurrent_slots(query, key.transpose(2, 3).contiguous().transpose(2, 3), value, g, beta, pool, slots,
                              slots)
    with pytest.raises(ValueError, match="backend must be one of"):
        recurrent_gated_delta_rule(query, key, value, g, beta, backend="cuda")
    with pytest.raises(ValueError, match="only the chunked form"):
        recurrent_gated_delta_rule(query, key, value, g, beta, backend="fla")


def test_cpu_tensors_take_the_torch_forms():
    """backend auto on CPU tensors is the torch form (the kernels only ever run on CUDA unless asked)."""
    query, key, value, g, beta = inputs(2, 1, 5, 1, 2, 8, 8)
    state = torch.randn(1, 2, 8, 8, device=DEVICE)
    for function in (recurrent_gated_delta_rule, chunked_gated_delta_rule):
        auto = function(query.cpu(), key.cpu(), value.cpu(), g.cpu(), beta.cpu(), state.cpu())
        forced = function(query.cpu(), key.cpu(), value.cpu(), g.cpu(), beta.cpu(), state.cpu(), backend="torch")
        for a, b in zip(auto, forced, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no bundled ptxas")
def test_recurrent_kernel_compiles_for_sm_90_without_spills():
    """Qwen3.6-35B-A3B's shapes (32 value heads over 16 key heads, Dk = Dv = 128), both value-block widths, bf16
    and fp32 models, compiled to a cubin for sm_90 by ptxas: no stack."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "cuda_compile.py"), "--only", "delta",
                             "--arch", "90"], env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok _fused_recurrent_kernel")]
    assert len(compiled) == 6, result.stdout
    spilled = [line for line in compiled if "stack 0," not in line or "local 0," not in line]
    assert not spilled, "\n".join(spilled)


# --- fla-core: imports here; the adapter's contract (with a stand-in); the fall back when it fails -------------


def test_fla_core_imports_without_a_gpu():
    """The decision's premise (kernels/gated_delta.py): fla-core's gated delta rule imports on a machine
    without a GPU (in a child process: its import warns and loads every op)."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", "import fla, fla.ops.gated_delta_rule as m; "
                             "print(fla.__version__, callable(m.chunk_gated_delta_rule))"],
                            cwd="/tmp", env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[1] == "True" and result.stdout.startswith("0.6"), result.stdout


def stand_in_for_fla(calls: list[dict]):
    """A chunk_gated_delta_rule with fla's call signature that checks what the adapter passes and computes
    the torch recurrent form (fla's scale is ours: Dk ** -0.5)."""
    def chunk(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, chunk_size):
        calls.append({"in_kernel": use_qk_l2norm_in_kernel, "chunk_size": chunk_size})
        assert scale == q.shape[-1] ** -0.5 and output_final_state
        assert q.dtype == k.dtype == v.dtype == beta.dtype and g.dtype == torch.float32
        assert initial_state is None or initial_state.dtype == torch.float32
        assert all(x.is_contiguous() for x in (q, k, v, g, beta))
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, l2norm_qk=use_qk_l2norm_in_kernel,
                                          backend="torch")
    return chunk


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
def test_fla_adapter_passes_fla_what_it_expects(monkeypatch, eps):
    """fla's in-kernel L2 norm has eps 1e-6: another eps is normalised before the call, same result."""
    import localserve.kernels.gated_delta as kernels

    calls = []
    monkeypatch.setattr(kernels, "_import_fla_chunk", lambda: stand_in_for_fla(calls))
    query, key, value, g, beta = inputs(4, 2, 7, 2, 2, 8, 8)
    state = torch.randn(2, 4, 8, 8, device=DEVICE)
    expected, expected_state = recurrent_gated_delta_rule(query, key, value, g, beta, state, l2norm_qk=True,
                                                          eps=eps, backend="torch")
    output, final = chunked_gated_delta_rule(query, key, value, g, beta, state, l2norm_qk=True, eps=eps,
                                             chunk_size=32, backend="fla")
    close(output, expected, 1e-5)
    close(final, expected_state, 1e-5)
    assert calls == [{"in_kernel": eps == 1e-6, "chunk_size": 32}]
    with pytest.raises(ValueError, match="chunk_size in"):
        chunked_gated_delta_rule(query, key, value, g, beta, chunk_size=8, backend="fla")


def test_auto_falls_back_to_torch_once_fla_fails(monkeypatch):
    """A failing fla (as a Triton it does not support would) warns once, then the torch form runs."""
    import localserve.kernels.gated_delta as kernels
    import localserve.models.layers.gated_delta as layer

    def broken(*args, **kwargs):
        raise RuntimeError("no such Triton API")

    monkeypatch.setattr(kernels, "_import_fla_chunk", lambda: broken)
    monkeypatch.setattr(kernels, "_fla_failure", [])
    monkeypatch.setattr(layer, "_backend", lambda value, backend, chunked, chunk_size=64:
                        backend if backend != "auto" else ("fla" if kernels.fla_chunk_function() else "torch"))
    query, key, value, g, beta = inputs(6, 1, 5, 1, 2, 8, 8)
    expected = chunked_gated_delta_rule(query, key, value, g, beta, backend="torch")
    with pytest.raises(RuntimeError, match="no such Triton API"):
        chunked_gated_delta_rule(query, key, value, g, beta, backend="fla")  # forced: raised, not hidden
    with pytest.warns(RuntimeWarning, match="runs in torch from now on"):
        output = chunked_gated_delta_rule(query, key, value, g, beta)
    assert kernels.fla_chunk_function() is None
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(chunked_gated_delta_rule(query, key, value, g, beta), expected)


# --- CUDA only: fla-core's chunked form and the dispatch -------------------------------------------------------


def fla_or_skip():
    from localserve.kernels.gated_delta import fla_chunk_function

    if fla_chunk_function() is None:
        pytest.skip("fla-core does not import here")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("length,with_state,gate", [(1, False, "mixed"), (63, True, "open"), (200, True, "mixed"),
                                                    (130, False, "closed"), (64, True, "mixed")])
def test_fla_chunked_equals_torch_recurrent(dtype, length, with_state, gate):
    fla_or_skip()
    query, key, value, g, beta = inputs(length, 2, length, 2, 2, 64, 32, gate, "mixed", dtype)
    state = torch.randn(2, 4, 64, 32, device=DEVICE) if with_state else None
    expected, expected_state = recurrent_gated_delta_rule(query, key, value, g, beta, state, l2norm_qk=True,
                                                          backend="torch")
    output, final = chunked_gated_delta_rule(query, key, value, g, beta, state, l2norm_qk=True, backend="fla")
    assert output.dtype == dtype and final.dtype == torch.float32
    # fla keeps its per-chunk states and WY factors in the inputs' dtype and multiplies on tensor cores (tf32 for
    # fp32 inputs); a wrong adapter (scale, layout, gate, state) is off by the whole scale
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-2
    close(output, expected, tolerance)
    close(final, expected_state, tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dispatch_and_split_prefill():
    """backend auto on CUDA: fla for the chunked form (where fla-core imports), our kernel for the recurrent
    one; a prompt prefilled in two pieces carrying the state, then decoded through a slot, equals the
    recurrent form over all its tokens (Qwen3.6-35B-A3B's heads and head sizes)."""
    query, key, value, g, beta = inputs(11, 1, 300, 16, 2, 128, 128, dtype=torch.bfloat16)
    expected, expected_state = recurrent_gated_delta_rule(query, key, value, g, beta, l2norm_qk=True,
                                                          backend="torch")
    first, state = chunked_gated_delta_rule(*(x[:, :150] for x in (query, key, value, g, beta)), l2norm_qk=True)
    second, state = chunked_gated_delta_rule(*(x[:, 150:299] for x in (query, key, value, g, beta)), state,
                                             l2norm_qk=True)
    pool = torch.zeros(2, 32, 128, 128, device=DEVICE)
    pool[1] = state
    slot = torch.tensor([1], device=DEVICE)
    last = recurrent_gated_delta_rule_slots(*(x[:, 299:] for x in (query, key, value, g, beta)), pool, slot, slot,
                                            l2norm_qk=True)
    close(torch.cat((first, second, last), dim=1), expected, 3e-2)
    close(pool[1], expected_state, 3e-2)
