"""bfloat16 (``EngineConfig(dtype="bfloat16")``, issue 26's fewer-bytes option): speculative
output equals the bf16 baseline's, token for token, on every GEMM path (the micro pair); and the
two facts behind it — oneDNN computes a bf16 row the same way at every M, and the CPU attention,
run in float32, gives a tree row the bf16 result of the same row decoded alone (a case bf16
SDPA gets wrong). Not a guarantee at every shape: docs/PERFORMANCE.md §6b."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.speculative.test_lossless import CONFIGS, prompts, run_staggered
from workbench.attention.paged import PagedAttention
from workbench.models.gemm import onednn_linear, onednn_ok, pack

BF16_KERNELS = torch.backends.mkldnn.is_available() and bool(
    torch.ops.mkldnn._is_mkldnn_bf16_supported())
GEMMS = ["dense", pytest.param("onednn", marks=pytest.mark.skipif(
    not BF16_KERNELS, reason="no oneDNN bf16 kernels on this CPU"))]


@pytest.fixture(scope="module", params=GEMMS)
def engine(request: pytest.FixtureRequest, micro_target: Path, trained_head: Path) -> wb.Engine:
    e = wb.Engine.from_pretrained(micro_target, draft=trained_head, config=wb.EngineConfig(
        dtype="bfloat16", gemm=request.param, compile="off", kv_budget_tokens=8192))
    assert e.runner.target is not None
    assert e.runner.target.lm_head.weight.dtype == torch.bfloat16
    assert e.choices["gemm"]["choice"] == request.param
    yield e
    e.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_speculative_equals_bf16_baseline(engine: wb.Engine, name: str) -> None:
    sp = wb.SamplingParams(max_new_tokens=24, ignore_eos=True)
    ps = prompts(6, seed=3)
    base = [o.token_ids for o in engine.generate(ps, sp)]
    for p, b in zip(ps, base, strict=True):  # bs=1, one at a time
        assert engine.generate([p], sp, spec=CONFIGS[name])[0].token_ids == b, name
    assert run_staggered(engine, ps, sp, CONFIGS[name], batch=3) == base, name


def test_a_trained_head_accepts_in_bf16(engine: wb.Engine) -> None:
    """Not a vacuous pass: the trees are accepted beyond their first token."""
    out = engine.generate(prompts(4, seed=5), wb.SamplingParams(max_new_tokens=24,
                                                               ignore_eos=True),
                          spec=CONFIGS["S5 K4 N16"])
    assert max(o.metrics.accept_length for o in out) > 1.2


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
