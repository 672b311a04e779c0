"""The CPU row kernel behind ``EngineConfig(batch_invariant=True)``: a row's attention is
bit-identical alone, in a causal chunk, in a tree, beside other requests and on any thread
count; and it is attention (the float64 reference, within float32 rounding)."""

from __future__ import annotations

import pytest
import torch

from workbench.attention.invariant import RowInvariantAttention
from workbench.kernels import cpu_row_attention as ra
from workbench.kernels.cpu_row_attention import plan_rows, row_attention, row_attention_reference

S, HKV, HD, H = 512, 2, 32, 6
DTYPES = [torch.float32, torch.bfloat16]


def pools(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(S, HKV, HD, generator=g).to(dtype),
            torch.randn(S, HKV, HD, generator=g).to(dtype))


# a 6-node tree: 0 root; 1, 2 children of 0; 3 child of 1; 4, 5 children of 2
PARENTS = [-1, 0, 0, 1, 2, 2]


def tree_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_alone_in_a_chunk_a_tree_and_a_batch(dtype: torch.dtype) -> None:
    kp, vp = pools(dtype)
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(S, generator=g)[:90]
    q = torch.randn(6, H, HD, generator=g)
    # decoded one at a time: row r sees slots[: 84 + r + 1]
    alone = torch.cat([row_attention(q[r : r + 1], kp, vp, plan_rows([1], [slots[: 85 + r]],
                                                                     None)) for r in range(6)])
    chunk = row_attention(q, kp, vp, plan_rows([6], [slots[:90]], None))
    assert torch.equal(alone, chunk)
    # the same 6 tokens as a chain tree, then beside two other requests and a rider
    chain = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(row_attention(q, kp, vp, plan_rows([6], [slots], [chain])), chunk)
    other = torch.randperm(S, generator=g)[:37]
    qq = torch.cat([torch.randn(3, H, HD, generator=g), q, torch.randn(1, H, HD, generator=g)])
    mixed = row_attention(qq, kp, vp, plan_rows([3, 6, 1], [other[:20], slots, other],
                                                [None, chain, None]))
    assert torch.equal(mixed[3:9], chunk)
    # a branching tree: node i's row equals the chain of its ancestors decoded alone
    tm = tree_mask(PARENTS)
    tree = row_attention(q, kp, vp, plan_rows([6], [slots], [tm]))
    for i in range(6):
        path = tm[i].nonzero().flatten()
        keys = torch.cat([slots[:84], slots[84:][path]])
        solo = row_attention(q[i : i + 1], kp, vp, plan_rows([1], [keys], None))
        assert torch.equal(tree[i], solo[0]), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_split_does_not_change_a_bit(dtype: torch.dtype,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    kp, vp = pools(dtype, 2)
    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(S, generator=g)[:200]
    q = torch.randn(200, H, HD, generator=g)
    plan = plan_rows([200], [slots], None)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = row_attention(q, kp, vp, plan)
        torch.set_num_threads(2)
        monkeypatch.setattr(ra, "SPLIT_WORK", 1)  # split even this small call
        two = row_attention(q, kp, vp, plan)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", DTYPES)
def test_it_is_attention(dtype: torch.dtype) -> None:
    kp, vp = pools(dtype, 4)
    g = torch.Generator().manual_seed(5)
    slots = torch.randperm(S, generator=g)[:70]
    q = torch.randn(6, H, HD, generator=g)
    plan = plan_rows([6], [slots], [tree_mask(PARENTS)])
    got = row_attention(q, kp, vp, plan)
    torch.testing.assert_close(got, row_attention_reference(q, kp, vp, plan), atol=2e-6, rtol=1e-5)
    # and a causal chunk against SDPA over the same keys
    causal = plan_rows([6], [slots], None)
    kk = kp[slots].float().transpose(0, 1)
    vv = vp[slots].float().transpose(0, 1)
    mask = torch.ones(6, 70, dtype=torch.bool).tril(64)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk.repeat_interleave(H // HKV, 0), vv.repeat_interleave(H // HKV, 0),
        attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(row_attention(q, kp, vp, causal), ref, atol=2e-6, rtol=1e-5)


def test_latent_values_are_the_keys_first_columns() -> None:
    """MLA's pool: values are a view of each key's first columns (v_row = hd)."""
    kp, _ = pools(torch.float32, 6)
    vp = kp[..., : HD // 2]
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(S, generator=g)[:40]
    q = torch.randn(3, H, HD, generator=g)
    plan = plan_rows([3], [slots], None)
    torch.testing.assert_close(row_attention(q, kp, vp, plan),
                               row_attention_reference(q, kp, vp, plan), atol=2e-6, rtol=1e-5)


def test_bad_pools_are_refused() -> None:
    kp, vp = pools(torch.float32)
    plan = plan_rows([1], [torch.arange(4)], None)
    q = torch.randn(1, H, HD)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        row_attention(q, kp.half(), vp.half(), plan)
    with pytest.raises(ValueError, match="plan has 1 rows"):
        row_attention(torch.randn(2, H, HD), kp, vp, plan)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        RowInvariantAttention(kp.half().unsqueeze(0), vp.half().unsqueeze(0), H)


def test_backend_writes_then_attends() -> None:
    """The backend writes the new tokens' K/V to their slots, then each row attends to its
    planned keys (its own included)."""
    k_pool = torch.zeros(2, 64, HKV, HD)
    v_pool = torch.zeros(2, 64, HKV, HD)
    att = RowInvariantAttention(k_pool, v_pool, H)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(3, H, HD, generator=g)
    k = torch.randn(3, HKV, HD, generator=g)
    v = torch.randn(3, HKV, HD, generator=g)
    att.plan(torch.tensor([10, 11, 12]), [3], [torch.tensor([10, 11, 12])])
    out = att.run(1, q, k, v)
    assert torch.equal(k_pool[1, 10:13], k) and torch.equal(v_pool[1, 10:13], v)
    assert not k_pool[0].any()
    # row 0 sees only itself: its output is its own value, head by head
    torch.testing.assert_close(out[0], v[0].repeat_interleave(H // HKV, 0))
