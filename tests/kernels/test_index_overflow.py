"""Block ids whose element offsets pass 2**31: the kernels must index the pool with 64-bit offsets.

It runs in a subprocess, because a 32-bit overflow reads or writes outside the pool and may kill the
process (Triton's interpreter included) instead of failing an assertion. The pool is allocated with
torch.empty, so on the CPU only the pages of the blocks used are ever touched.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.kv_pools import DEVICE

SCRIPT = textwrap.dedent("""
    import torch
    import localserve.kernels  # before triton: picks the interpreter without CUDA
    from localserve.kernels.attention_plan import plan_attention
    from localserve.kernels.kv_format import Q8_0, KernelFormat, KVStore
    from localserve.kernels.paged_attention import paged_attention
    from localserve.kernels.store_kv import store_kv
    from localserve.kv.quantization import rotation_matrix

    device, heads, kv_heads, dim, block_size = "{device}", 4, 1, 64, 16
    high = 2 ** 21 + 5  # q8_0 codes take 1024 int8 per block: block ids past 2**21 pass 2**31 elements
    table = [high, high - 2 ** 20, high + 3]
    fmt = KernelFormat(Q8_0, encode_matrix=rotation_matrix(dim).to(device).expand(kv_heads, dim, dim))

    def pool(num_blocks):
        return [KVStore(torch.empty(num_blocks, block_size, kv_heads, dim, dtype=torch.int8, device=device),
                        torch.empty(num_blocks, block_size, kv_heads, dim // 32, dtype=torch.float16, device=device))
                for _ in range(2)]

    generator = torch.Generator().manual_seed(0)
    key, value = (torch.randn(40, kv_heads, dim, generator=generator).to(device) for _ in range(2))
    query = torch.randn(5, heads, dim, generator=generator).to(device)
    outputs, stored = [], []
    for blocks, num_blocks in ((table, high + 4), ([0, 1, 2], 3)):
        stores = pool(num_blocks)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(40)],
                             device=device)
        for x, store in zip((key, value), stores):
            store_kv(x, slots, store, fmt)
        ids = torch.tensor(blocks, device=device)
        stored.append([t.flatten(0, 1)[slots].cpu() for store in stores for t in (store.data, store.scales)])
        for num_splits in (1, 2):
            plan = plan_attention([5], [40], ids[None, :], heads, kv_heads, num_splits=num_splits)
            outputs.append(paged_attention(query, *stores, fmt, fmt, plan, dim ** -0.5).cpu())
    assert all(torch.equal(a, b) for a, b in zip(*stored)), "stored bytes differ at high block ids"
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3]), "outputs differ"
    print("same at high block ids")
""")


def test_high_block_ids_store_and_attend_like_low_ones():
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(device=DEVICE)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "same at high block ids" in result.stdout
