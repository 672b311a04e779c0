"""PagedAttention's per-forward plan: the one-run view path, the additive verify mask, and the
KV pool's slot fast path it is fed by (issue 18)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from workbench.attention.paged import PagedAttention
from workbench.engine.kv_cache import KVPool

L, HKV, H, HD = 2, 2, 4, 8


def _pools(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(L, slots, HKV, HD, generator=g),
            torch.randn(L, slots, HKV, HD, generator=g))


def test_slots_fast_path_matches_the_block_table() -> None:
    pool = KVPool(32, 4, 1, 1, 2, torch.float32, "cpu")
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        blocks = rng.sample(range(32), n) if rng.random() < 0.5 else list(range(5, 5 + n))
        start = rng.randint(0, 4 * n)
        end = rng.randint(start, 4 * n)
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.int64)
        assert pool.slots(blocks, start, end).tolist() == (table[pos // 4] * 4 + pos % 4).tolist()
        want = pool.slots(blocks, start, end).tolist()
        assert pool.slot_list(blocks, start, end) == want
        # KVPool.run: the first slot exactly when the slots are one ascending run
        one_run = bool(want) and want == list(range(want[0], want[0] + len(want)))
        assert pool.run(blocks, start, end) == (want[0] if one_run else None)
    assert pool.run([3, 4], 0, 9) is None  # beyond the request's blocks


def _run(att: PagedAttention, q: torch.Tensor, k: torch.Tensor,
         v: torch.Tensor) -> list[torch.Tensor]:
    return [att.run(layer, q, k, v) for layer in range(L)]


def test_one_run_path_writes_and_attends_like_the_gather_path() -> None:
    """A request whose slots are one run (views) vs the same positions at scattered slots
    (index_copy_ + gather): same pool writes, same outputs."""
    k0, v0 = _pools(64)
    t, prefix = 3, 9
    run_slots = torch.arange(20, 20 + prefix + t)
    scattered = torch.tensor(random.Random(1).sample(range(64), prefix + t))
    kp2, vp2 = k0.clone(), v0.clone()
    kp2[:, scattered] = k0[:, run_slots]
    vp2[:, scattered] = v0[:, run_slots]
    a = PagedAttention(k0, v0, H)
    b = PagedAttention(kp2, vp2, H)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(t, H, HD, generator=g), torch.randn(t, HKV, HD, generator=g),
               torch.randn(t, HKV, HD, generator=g))
    a.plan(run_slots[prefix:], [t], [run_slots])
    b.plan(scattered[prefix:], [t], [scattered])
    assert a.span_k is not None and b.span_k is None
    for oa, ob in zip(_run(a, q, k, v), _run(b, q, k, v), strict=True):
        torch.testing.assert_close(oa, ob, rtol=1e-6, atol=1e-6)
    assert torch.equal(a.k_pool[:, run_slots], b.k_pool[:, scattered])
    assert torch.equal(a.v_pool[:, run_slots], b.v_pool[:, scattered])


def test_verify_mask_is_additive_and_bit_identical_to_the_bool_mask() -> None:
    k0, v0 = _pools(64)
    t, prefix = 4, 6
    slots = torch.arange(10, 10 + prefix + t)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    att = PagedAttention(k0.clone(), v0.clone(), H)
    att.plan(slots[prefix:], [t], [slots], [tree])
    assert att.mask is not None and att.mask.dtype == torch.float32
    bool_mask = torch.cat([torch.ones(t, prefix, dtype=torch.bool), tree], 1)
    assert torch.equal(att.mask[0, 0] == 0, bool_mask)
    assert bool(torch.isinf(att.mask[0, 0][~bool_mask]).all())
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(t, H, HD, generator=g), torch.randn(t, HKV, HD, generator=g),
               torch.randn(t, HKV, HD, generator=g))
    out = att.run(0, q, k, v)
    kk = att.k_pool[0, slots].unsqueeze(0).transpose(1, 2)
    vv = att.v_pool[0, slots].unsqueeze(0).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q.unsqueeze(0).transpose(1, 2), kk, vv,
                                         attn_mask=bool_mask.view(1, 1, t, -1), enable_gqa=True)
    assert torch.equal(out, ref.transpose(1, 2).reshape(t, H, HD))


def test_ragged_batch_rows_match_each_request_alone() -> None:
    """A verify tree next to a one-token rider (ragged: padded query rows, padded keys): each
    request's rows are its rows when planned alone (same pool writes, same attention)."""
    k0, v0 = _pools(64)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    a_slots, b_slots = torch.arange(0, 8), torch.tensor([40, 41, 50, 51, 52])
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, H, HD, generator=g), torch.randn(4, HKV, HD, generator=g),
               torch.randn(4, HKV, HD, generator=g))
    both = PagedAttention(k0.clone(), v0.clone(), H)
    both.plan(torch.cat([a_slots[5:], b_slots[4:]]), [3, 1], [a_slots, b_slots], [tree, None])
    out = both.run(0, q, k, v)
    alone_a = PagedAttention(k0.clone(), v0.clone(), H)
    alone_a.plan(a_slots[5:], [3], [a_slots], [tree])
    alone_b = PagedAttention(k0.clone(), v0.clone(), H)
    alone_b.plan(b_slots[4:], [1], [b_slots])
    torch.testing.assert_close(out[:3], alone_a.run(0, q[:3], k[:3], v[:3]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[3:], alone_b.run(0, q[3:], k[3:], v[3:]), rtol=1e-6, atol=1e-6)


def test_plan_run_equals_plan_from_the_slots() -> None:
    """plan_run(lo, lk, lq, mask) (host ints, as the engine plans one request) makes the views,
    pool writes, mask and outputs plan makes from the same slots: decode, extend and verify."""
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    for lq, lk, tm in ((1, 12, None), (3, 12, None), (5, 5, None), (4, 12, tree)):
        slots = torch.arange(30, 30 + lk)
        k0, v0 = _pools(64)
        a = PagedAttention(k0.clone(), v0.clone(), H)
        b = PagedAttention(k0.clone(), v0.clone(), H)
        a.plan(slots[lk - lq :], [lq], [slots], None if tm is None else [tm])
        b.plan_run(30, lk, lq, tm)
        assert (a.q_shape, a.is_causal, a.q_index) == (b.q_shape, b.is_causal, b.q_index)
        assert (a.mask is None) == (b.mask is None)
        if a.mask is not None and b.mask is not None:
            assert torch.equal(a.mask, b.mask)
        g = torch.Generator().manual_seed(lq)
        q, k, v = (torch.randn(lq, H, HD, generator=g), torch.randn(lq, HKV, HD, generator=g),
                   torch.randn(lq, HKV, HD, generator=g))
        for oa, ob in zip(_run(a, q, k, v), _run(b, q, k, v), strict=True):
            assert torch.equal(oa, ob)
        assert torch.equal(a.k_pool, b.k_pool) and torch.equal(a.v_pool, b.v_pool)


def test_a_short_causal_mask_is_a_view_with_the_contiguous_masks_bits() -> None:
    """A draft extend's few rows after a long prefix: the mask is a view of a wide buffer (no
    op per forward), equal to the prefix zeros + causal block, and SDPA gives the same bits
    from it as from that contiguous mask, also after the buffer widens."""
    k0, v0 = _pools(700)
    att = PagedAttention(k0, v0, H)
    g = torch.Generator().manual_seed(7)
    for lq, lk in ((3, 40), (3, 600), (5, 300), (16, 17)):
        att.plan_run(0, lk, lq, None)
        assert att.mask is not None and not att.is_causal
        block = torch.zeros(lq, lq).masked_fill_(~torch.ones(lq, lq, dtype=torch.bool).tril(),
                                                 float("-inf"))
        want = torch.cat([torch.zeros(lq, lk - lq), block], 1).view(1, 1, lq, lk)
        assert torch.equal(att.mask, want)
        q = torch.randn(1, H, lq, HD, generator=g)
        kk, vv = (torch.randn(1, HKV, lk, HD, generator=g) for _ in range(2))
        assert torch.equal(F.scaled_dot_product_attention(q, kk, vv, attn_mask=att.mask,
                                                          enable_gqa=True),
                           F.scaled_dot_product_attention(q, kk, vv, attn_mask=want,
                                                          enable_gqa=True))
