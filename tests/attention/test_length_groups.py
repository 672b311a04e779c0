"""PagedAttention's length groups (issue 40): a ragged batch with a few long contexts is attended
by one SDPA call per group of similar key length, each over keys padded to its own longest, not
the batch's; each request's rows equal those of a batch of its group alone."""

from __future__ import annotations

import random

import torch

import workbench.attention.paged as paged
from workbench.attention.paged import PagedAttention, length_groups

L, HKV, H, HD = 2, 2, 4, 8
SLOTS = 2048


def _pools() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(L, SLOTS, HKV, HD, generator=g),
            torch.randn(L, SLOTS, HKV, HD, generator=g))


def _tree(q: int) -> torch.Tensor:
    """A random ancestor mask over q tree nodes (node 0 the root)."""
    rng = random.Random(q)
    m = torch.eye(q, dtype=torch.bool)
    for j in range(1, q):
        m[j] |= m[rng.randrange(j)]
    return m


def _batch(k_lens: list[int], q_lens: list[int], tree: bool,
           ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None] | None]:
    """write slots, per-request slots (scattered, disjoint) and tree masks of a ragged batch."""
    perm = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(1))
    kv, o = [], 0
    for n in k_lens:
        kv.append(perm[o : o + n])
        o += n
    write = torch.cat([s[len(s) - q :] for s, q in zip(kv, q_lens, strict=True)])
    masks = [_tree(q) if q > 1 else None for q in q_lens] if tree else None
    return write, kv, masks


def test_groups_split_a_few_long_contexts_from_many_short_ones() -> None:
    short, long = [40] * 31, [163] * 4
    got = length_groups([16] * 35, short + long)
    assert got == [list(range(31)), list(range(31, 35))]
    # batch order inside a group, every request once, groups by ascending key length
    mixed = [163, 40, 41, 170, 39]
    assert length_groups([16] * 5, mixed) == [[1, 2, 4], [0, 3]]
    # similar lengths stay one call (each call costs GROUP_OVERHEAD)
    assert length_groups([16] * 5, [20, 25, 30, 35, 40]) == [[0, 1, 2, 3, 4]]
    assert length_groups([1] * 3, [9, 9, 9]) == [[0, 1, 2]]


def test_each_request_rows_equal_its_group_alone_and_one_call_within_rounding(
        monkeypatch) -> None:
    k_lens = [40, 38, 163, 41, 150, 37, 39]
    q_lens = [16, 16, 16, 1, 16, 16, 1]  # verify trees and one-token riders
    write, kv, masks = _batch(k_lens, q_lens, tree=True)
    g = torch.Generator().manual_seed(3)
    t = sum(q_lens)
    q, k, v = (torch.randn(t, H, HD, generator=g), torch.randn(t, HKV, HD, generator=g),
               torch.randn(t, HKV, HD, generator=g))
    k0, v0 = _pools()
    grouped = PagedAttention(k0.clone(), v0.clone(), H)
    grouped.plan(write, q_lens, kv, masks)
    assert grouped.groups is not None and len(grouped.groups) == 2
    out = [grouped.run(layer, q, k, v) for layer in range(L)]
    # the same batch as one call (the plan before length groups)
    monkeypatch.setattr(paged, "length_groups", lambda ql, kl: [list(range(len(ql)))])
    one = PagedAttention(k0.clone(), v0.clone(), H)
    one.plan(write, q_lens, kv, masks)
    assert one.groups is None
    for layer in range(L):
        torch.testing.assert_close(out[layer], one.run(layer, q, k, v), rtol=1e-5, atol=1e-6)
    assert torch.equal(grouped.k_pool, one.k_pool) and torch.equal(grouped.v_pool, one.v_pool)
    # bit for bit: each group's rows are those of a batch of that group alone
    starts = [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
    for members in ([0, 1, 3, 5, 6], [2, 4]):
        rows = [r for i in members for r in range(starts[i], starts[i + 1])]
        alone = PagedAttention(k0.clone(), v0.clone(), H)
        alone.plan(write[rows], [q_lens[i] for i in members], [kv[i] for i in members],
                   [masks[i] for i in members] if masks is not None else None)
        for layer in range(L):
            assert torch.equal(out[layer][rows], alone.run(layer, q[rows], k[rows], v[rows]))


def test_one_sdpa_call_per_group_over_its_own_longest_keys(monkeypatch) -> None:
    """Counted, not timed: the short requests' call sees keys padded to their own longest,
    never to the long requests' length."""
    calls: list[tuple[int, int, int]] = []
    sdpa = paged.F.scaled_dot_product_attention

    def counting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 **kw: object) -> torch.Tensor:
        calls.append((k.shape[0], q.shape[2], k.shape[2]))  # requests, query rows, keys
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(paged.F, "scaled_dot_product_attention", counting)
    k_lens, q_lens = [30] * 12 + [400] * 2, [16] * 14
    write, kv, masks = _batch(k_lens, q_lens, tree=True)
    att = PagedAttention(*_pools(), H)
    att.plan(write, q_lens, kv, masks)
    g = torch.Generator().manual_seed(5)
    t = sum(q_lens)
    att.run(0, torch.randn(t, H, HD, generator=g), torch.randn(t, HKV, HD, generator=g),
            torch.randn(t, HKV, HD, generator=g))
    assert sorted(calls) == [(2, 16, 400), (12, 16, 30)]
    # a batch of similar lengths: one call, as before
    calls.clear()
    write, kv, masks = _batch([30, 31, 32], [16] * 3, tree=True)
    att.plan(write, [16] * 3, kv, masks)
    assert att.groups is None
    att.run(0, torch.randn(48, H, HD, generator=g), torch.randn(48, HKV, HD, generator=g),
            torch.randn(48, HKV, HD, generator=g))
    assert calls == [(3, 16, 32)]


def test_a_prefill_chunk_beside_decode_rows_is_its_own_group() -> None:
    """Query padding counts too: a 99-token prefill beside one-token decodes, causal, no tree;
    rows equal each group alone."""
    k_lens, q_lens = [99, 20, 22, 25, 21], [99, 1, 1, 1, 1]
    write, kv, _ = _batch(k_lens, q_lens, tree=False)
    assert length_groups(q_lens, k_lens) == [[1, 2, 3, 4], [0]]
    k0, v0 = _pools()
    att = PagedAttention(k0.clone(), v0.clone(), H)
    att.plan(write, q_lens, kv)
    g = torch.Generator().manual_seed(6)
    t = sum(q_lens)
    q, k, v = (torch.randn(t, H, HD, generator=g), torch.randn(t, HKV, HD, generator=g),
               torch.randn(t, HKV, HD, generator=g))
    out = att.run(1, q, k, v)
    pre = PagedAttention(k0.clone(), v0.clone(), H)
    pre.plan(write[:99], [99], [kv[0]])
    assert torch.equal(out[:99], pre.run(1, q[:99], k[:99], v[:99]))
    dec = PagedAttention(k0.clone(), v0.clone(), H)
    dec.plan(write[99:], [1] * 4, kv[1:])
    assert torch.equal(out[99:], dec.run(1, q[99:], k[99:], v[99:]))
