"""bfloat16 without row-invariant numerics: the facts the torch attention backend rests on —
oneDNN computes a bf16 row the same way at every M, and the CPU attention, run in float32,
gives a tree row the bf16 result of the same row decoded alone (a case bf16 SDPA gets wrong).
Not a guarantee at every shape (float32 SDPA rounds by the padded length), which is why a bf16
engine with a draft must pass the self-check's row probe or refuse, and why lossless bf16
speculation is ``EngineConfig(batch_invariant=True)``: tests/speculative/
test_batch_invariant_lossless.py, tests/engine/test_batch_invariant.py."""

from __future__ import annotations

import pytest
import torch

from workbench.attention.paged import PagedAttention
from workbench.models.gemm import onednn_linear, onednn_ok, pack

BF16_KERNELS = torch.backends.mkldnn.is_available() and bool(
    torch.ops.mkldnn._is_mkldnn_bf16_supported())
GEMMS = ["dense", pytest.param("onednn", marks=pytest.mark.skipif(
    not BF16_KERNELS, reason="no oneDNN bf16 kernels on this CPU"))]


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 kernels on this CPU")
def test_onednn_bf16_rows_do_not_depend_on_m() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    assert onednn_ok(w)
    p = pack(w)
    x = torch.randn(70, 64, generator=gen).to(torch.bfloat16)
    first = onednn_linear(x[:1], p, None)
    for m in (2, 6, 16, 17, 33, 70):  # exact, padded to 32 / 64, a multiple of 64
        assert torch.equal(onednn_linear(x[:m], p, None)[:1], first), m


def test_cpu_attention_in_bf16_runs_a_tree_row_like_a_decode_row() -> None:
    """The root cause of bf16 trees disagreeing with their baseline: SDPA's bf16 CPU kernel
    with a mask rounds a row differently from the same row alone. In float32 they agree."""
    gen = torch.Generator().manual_seed(1)
    layers, slots, hkv, hd, h, ctx = 1, 64, 2, 16, 4, 40
    k_pool = torch.randn(layers, slots, hkv, hd, generator=gen).to(torch.bfloat16)
    v_pool = torch.randn(layers, slots, hkv, hd, generator=gen).to(torch.bfloat16)
    a = PagedAttention(k_pool, v_pool, h)
    assert a.sdpa_dtype == torch.float32
    # a 4-node tree over a 36-token prefix: node 3's ancestors are 0 and 2 (not 1)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    q = torch.randn(4, h, hd, generator=gen).to(torch.bfloat16)
    k = torch.randn(4, hkv, hd, generator=gen).to(torch.bfloat16)
    v = torch.randn(4, hkv, hd, generator=gen).to(torch.bfloat16)
    prefix = torch.arange(ctx - 4)
    a.plan(torch.arange(ctx - 4, ctx), [4], [torch.arange(ctx)], [tree])
    tree_out = a.run(0, q, k, v)
    # node 3 decoded alone, its ancestors 0 and 2 already in the cache
    k_pool[0, ctx - 4], v_pool[0, ctx - 4] = k[0], v[0]
    k_pool[0, ctx + 2], v_pool[0, ctx + 2] = k[2], v[2]
    a.plan(torch.tensor([ctx + 3]), [1],
           [torch.cat([prefix, torch.tensor([ctx - 4, ctx + 2, ctx + 3])])])
    alone = a.run(0, q[3:], k[3:], v[3:])
    assert tree_out.dtype == alone.dtype == torch.bfloat16
    assert torch.equal(tree_out[3], alone[0])
