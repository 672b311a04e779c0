"""KVPool: block accounting (reserve, trim, release), slot mapping and compaction by index."""

from __future__ import annotations

import random

import pytest
import torch

from workbench.engine.kv_cache import KVPool
from workbench.errors import KVExhausted, WorkbenchError


def pool(blocks: int = 6, page: int = 4, layers: int = 2, draft: bool = False) -> KVPool:
    return KVPool(blocks, page, layers, kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu", draft_shape=(1, 2) if draft else None)


def test_shapes_and_bytes() -> None:
    p = pool(draft=True)
    assert tuple(p.k.shape) == tuple(p.v.shape) == (2, 24, 1, 2)
    assert p.dk is not None and tuple(p.dk.shape) == (1, 24, 1, 2)
    assert p.nbytes == (2 * 24 * 2 * 2 + 24 * 2 * 2) * 4
    assert pool().dk is None and pool().nbytes == 2 * 24 * 2 * 2 * 4
    assert p.used_blocks == 0 and len(p.free) == 6


def test_reserve_grows_in_place_and_hands_out_ascending_blocks() -> None:
    p = pool()
    a: list[int] = []
    assert p.blocks_needed(a, 5) == 2 and p.can_fit(a, 5)
    p.reserve(a, 5)
    assert a == [0, 1] and p.used_blocks == 2
    p.reserve(a, 8)  # still two pages: nothing new
    assert a == [0, 1]
    p.reserve(a, 9)
    assert a == [0, 1, 2]
    b: list[int] = []
    p.reserve(b, 1)
    assert b == [3]
    assert p.blocks_needed(a, 0) == 0 and p.blocks_needed(a, 12) == 0
    assert p.used_blocks == 4


def test_exhaustion_raises_kv_exhausted_and_changes_nothing() -> None:
    p = pool(blocks=3)
    a: list[int] = []
    p.reserve(a, 8)
    b = [a.pop()]  # a holds [0], b [1]; one block free
    assert not p.can_fit(b, 12)
    free = list(p.free)
    with pytest.raises(KVExhausted, match="need 2 blocks, 1 free") as e:
        p.reserve(b, 12)
    assert isinstance(e.value, WorkbenchError) and (e.value.need, e.value.free) == (2, 1)
    assert b == [1] and p.free == free
    p.reserve(b, 8)  # what fits still fits
    assert b == [1, 2] and not p.free


def test_release_returns_blocks_for_reuse_in_the_same_order() -> None:
    p = pool()
    a: list[int] = []
    p.reserve(a, 12)
    held = list(a)
    p.release(a)
    assert a == [] and p.used_blocks == 0
    b: list[int] = []
    p.reserve(b, 12)
    assert b == held


def test_trim_returns_blocks_past_the_kept_positions() -> None:
    """After a verify the rejected lookahead's pages go back (rewind by length, no copy)."""
    p = pool()
    a: list[int] = []
    p.reserve(a, 16)
    p.trim(a, 9)  # positions [0, 9) need 3 pages
    assert a == [0, 1, 2] and p.used_blocks == 3
    p.trim(a, 12)  # a partial page is kept; growing is reserve's job
    assert a == [0, 1, 2]
    p.trim(a, 0)
    assert a == [] and p.used_blocks == 0


def test_slots_follow_the_block_table() -> None:
    p = pool()
    table = [4, 1, 3]
    s = p.slots(table, 0, 12)
    assert s.dtype == torch.int64 and s.device.type == "cpu"
    assert s.tolist() == [16, 17, 18, 19, 4, 5, 6, 7, 12, 13, 14, 15]
    assert p.slots(table, 3, 9).tolist() == [19, 4, 5, 6, 7, 12]
    assert p.slots(table, 5, 5).tolist() == []


def test_compact_moves_accepted_path_into_place_in_every_layer() -> None:
    """Acceptance packs the accepted tree nodes to the front of the block, by index: sources
    are read before destinations are written, so overlapping moves are exact."""
    p = pool(blocks=2, page=4, layers=3)
    p.k.copy_(torch.arange(p.k.numel(), dtype=torch.float32).view_as(p.k))
    p.v.copy_(-p.k)
    k0, v0 = p.k.clone(), p.v.clone()
    src, dst = torch.tensor([2, 4, 7]), torch.tensor([1, 2, 3])  # slot 2 is read and written
    p.compact(src, dst)
    for layer in range(3):
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            assert torch.equal(p.k[layer, d], k0[layer, s])
            assert torch.equal(p.v[layer, d], v0[layer, s])
        untouched = [i for i in range(8) if i not in dst.tolist()]
        assert torch.equal(p.k[layer, untouched], k0[layer, untouched])
        assert torch.equal(p.v[layer, untouched], v0[layer, untouched])


def test_random_traffic_never_leaks_or_double_books() -> None:
    """Every block is either free or held by exactly one request, whatever the sequence."""
    rng = random.Random(0)
    p = pool(blocks=16, page=4)
    held: list[list[int]] = [[] for _ in range(5)]
    for _ in range(2000):
        r = held[rng.randrange(5)]
        op = rng.random()
        n = rng.randrange(0, 30)
        if op < 0.5:
            if p.can_fit(r, n):
                p.reserve(r, n)
            else:
                with pytest.raises(KVExhausted):
                    p.reserve(r, n)
        elif op < 0.8:
            p.trim(r, n)
        else:
            p.release(r)
        everything = p.free + [b for h in held for b in h]
        assert sorted(everything) == list(range(16))
        assert p.used_blocks == sum(len(h) for h in held)
    for h in held:
        p.release(h)
    assert p.used_blocks == 0


def test_compact_takes_host_lists_and_checks_them() -> None:
    """The engine's commit hands the slots over as host lists: the same moves as tensors, and
    the same value checks (read on the lists)."""
    a, b = pool(blocks=2, page=4, layers=2), pool(blocks=2, page=4, layers=2)
    for p in (a, b):
        p.k.copy_(torch.arange(p.k.numel(), dtype=torch.float32).view_as(p.k))
        p.v.copy_(-p.k)
    a.compact(torch.tensor([2, 4, 7]), torch.tensor([1, 2, 3]))
    b.compact([2, 4, 7], [1, 2, 3])
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    b.compact([], [])  # nothing to move
    assert torch.equal(a.k, b.k)
    with pytest.raises(ValueError, match="distinct"):
        b.compact([1, 2], [3, 3])
    with pytest.raises(ValueError, match=r"in \[0, S"):
        b.compact([99], [1])
    with pytest.raises(ValueError, match="one length"):
        b.compact([1, 2], [3])


def test_keys_and_values_share_one_tensor_and_compact_together() -> None:
    """Keys and values are the halves of one tensor (each contiguous): a CPU compaction moves
    both in one gather and one scatter, exactly as the reference kernel moves each."""
    from workbench.kernels import reference

    p = pool(blocks=2, page=4, layers=3)
    assert p.kv is not None and p.k.is_contiguous() and p.v.is_contiguous()
    assert p.k.data_ptr() == p.kv.data_ptr() and p.v.data_ptr() == p.kv[1].data_ptr()
    p.k.copy_(torch.randn(p.k.shape, generator=torch.Generator().manual_seed(0)))
    p.v.copy_(torch.randn(p.v.shape, generator=torch.Generator().manual_seed(1)))
    k, v = p.k.clone(), p.v.clone()
    src, dst = [5, 2, 7], [2, 3, 4]
    p.compact(src, dst)
    reference.compact_kv(k, v, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(p.k, k) and torch.equal(p.v, v)
