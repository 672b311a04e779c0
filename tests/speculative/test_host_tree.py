"""The CPU one-request tree (``host_tree.draft_tree_one``) equals the tensor path field by
field: the same draft calls (tokens, positions, ancestors), the same tree, ties included."""

from __future__ import annotations

import math
from array import array

import pytest
import torch
import torch.nn.functional as F
from speculative.test_drafter import (
    FakeDraft,
    encode,
    hand_dist,
    random_dist,
    run_draft,
)

from workbench.attention.tree_draft import TreeDraftAttention
from workbench.core import DraftTree
from workbench.speculative import host_tree
from workbench.speculative.drafter import draft_tree
from workbench.speculative.host_tree import draft_tree_one, target_list


def both(dist: object, steps: int, topk: int, n: int, root_pos: int,
         temperature: float | None) -> tuple[tuple[DraftTree, FakeDraft], ...]:
    """(host path, tensor path): an ``on_step`` callback sends B = 1 down the tensor path."""
    host = run_draft(dist, 1, steps, topk, n, [root_pos],  # type: ignore[arg-type]
                     None if temperature is None else [temperature])
    seen: list[int] = []
    tensor = run_draft(dist, 1, steps, topk, n, [root_pos],  # type: ignore[arg-type]
                       None if temperature is None else [temperature],
                       on_step=lambda depth, *_: seen.append(depth))
    assert seen == list(range(1, steps + 1))  # the tensor path did run
    return host, tensor


def uniform(req: int, path: tuple[int, ...]) -> list[float]:
    """Every token alike: every score ties, so only the orders' tie-breaking decides."""
    return [1 / 9] * 9


@pytest.mark.parametrize("dist,shape,temperature", [
    (hand_dist, (3, 2, 6), None),
    (random_dist(3, 40), (5, 4, 16), None),
    (random_dist(4, 40), (5, 4, 16), 0.4),
    (random_dist(5, 60), (6, 8, 32), 0.7),
    (random_dist(6, 12), (4, 3, 40), None),  # fewer candidates than N−1: all kept
    (random_dist(7, 30), (1, 4, 4), None),  # one step: children of the root only
    (random_dist(8, 30), (5, 1, 6), None),  # a chain
    (uniform, (4, 3, 10), None),
    (uniform, (3, 9, 20), 0.5),
])
def test_host_tree_equals_the_tensor_path(dist: object, shape: tuple[int, int, int],
                                          temperature: float | None) -> None:
    (h, hf), (t, tf) = both(dist, *shape, root_pos=17, temperature=temperature)
    for field in ("tokens", "parents", "depth", "positions", "mask", "scores", "draft_probs"):
        a, b = getattr(h, field), getattr(t, field)
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert torch.equal(a, b), field
    # the host lists it carries for the accept are its tensors' values; the tensor path has none
    assert h.host == (h.tokens.tolist(), h.parents.tolist()) and t.host is None
    assert [c["paths"] for c in hf.calls] == [c["paths"] for c in tf.calls]
    assert [c["positions"] for c in hf.calls] == [c["positions"] for c in tf.calls]
    for a, b in zip(hf.calls, tf.calls, strict=True):  # the host's additive, the tensor's bool
        assert a["anc"].dtype == torch.float32 and b["anc"].dtype == torch.bool
        assert torch.equal(a["anc"] == 0, b["anc"])
        assert torch.equal(a["anc"] != 0, a["anc"] == float("-inf"))


def test_host_tree_takes_a_float_or_tensor_temperature_alike() -> None:
    dist = random_dist(11, 40)
    fake = FakeDraft(dist)
    logits0 = torch.tensor([[math.log(p) for p in dist(0, ())]])
    hidden0 = torch.tensor([encode(0, ())])
    pool = torch.zeros(1, 64, 1, 2)
    args = (fake, logits0, hidden0, torch.tensor([7]), torch.tensor([9]), [torch.arange(9)],
            pool, pool.clone(), 4, 3, 10)
    a = draft_tree(*args, score_temperature=0.4)  # type: ignore[arg-type]
    b = draft_tree(*args, score_temperature=torch.tensor([0.4]))  # type: ignore[arg-type]
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.scores, b.scores)


def test_host_float32_sums_are_the_tensor_sums() -> None:
    """The host scores: a float32 + float32 sum done in double, rounded by ``array('f')``, is
    bit for bit torch's float32 sum (ties to even, extreme exponents, subnormals, ±inf), and
    ``0.0 if v > 0.0 else v`` is ``clamp(max=0)`` (NaN and -inf kept)."""
    g = torch.Generator().manual_seed(0)
    a = torch.cat([-torch.rand(20000, generator=g) * 30,
                   -torch.exp(torch.randn(20000, generator=g) * 20),  # 1e-40 .. 1e+40
                   torch.tensor([0.0, -0.0, -1e-45, -3.4e38, float("-inf"), 2.0 ** -24,
                                 1.0, -1.0 - 2.0 ** -23])])
    b = a[torch.randperm(a.numel(), generator=g)]
    host = array("f", [x + y for x, y in zip(a.tolist(), b.tolist(), strict=True)])
    want = (a + b).tolist()
    assert [math.isnan(x) for x in host] == [math.isnan(x) for x in want]
    assert all(x == y or math.isnan(x) for x, y in zip(host, want, strict=True))
    # the sign of a zero is kept too (the tensor path's scores are compared by value only)
    assert torch.equal(torch.frombuffer(host, dtype=torch.int32), (a + b).view(torch.int32))
    v = torch.tensor([1e-7, 0.0, -0.0, -1e-30, float("-inf"), float("nan"), 3.0, -2.5])
    clamped = [0.0 if x > 0.0 else x for x in v.tolist()]
    assert torch.equal(torch.tensor(clamped).view(torch.int32),
                       v.clamp(max=0.0).view(torch.int32))


class _ExtremeDraft(FakeDraft):
    """The fake draft with -inf and huge logits: -inf log-probs (tied), exact-0 tops."""

    def __call__(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 attn: object) -> tuple[torch.Tensor, torch.Tensor]:
        logits, out = super().__call__(tokens, hidden, positions, attn)
        logits[:, 3:] = float("-inf")
        logits[:, 1] = float("-inf")  # two finite children per row: K − 2 of -inf
        logits[1::2, 0] = 1e4  # a row whose top has log-prob 0, the other -1e4
        return logits, out


@pytest.mark.parametrize("temperature", [None, 0.5])
def test_host_tree_equals_the_tensor_path_with_inf_and_certain_rows(
        temperature: float | None) -> None:
    dist = random_dist(21, 30)
    trees = []
    for on_step in (None, lambda *_: None):
        fake = _ExtremeDraft(dist)
        logits0 = torch.tensor([[math.log(p) for p in dist(0, ())]])
        logits0[0, 2::3] = float("-inf")
        args = (fake, logits0, torch.tensor([encode(0, ())]), torch.tensor([7]),
                torch.tensor([9]), [torch.arange(9)], torch.zeros(1, 64, 1, 2),
                torch.zeros(1, 64, 1, 2), 5, 4, 40)
        trees.append(draft_tree(*args, on_step=on_step,  # type: ignore[arg-type]
                                score_temperature=temperature))
    h, t = trees
    assert bool(torch.isinf(h.scores).any())  # -inf candidates made it into the tree
    assert bool((h.scores < -1e3).logical_and(h.scores > -1e5).any())  # very negative ones
    for field in ("tokens", "parents", "depth", "positions", "mask", "scores", "draft_probs"):
        assert torch.equal(getattr(h, field), getattr(t, field)), field


def test_target_list_follows_its_table() -> None:
    """The host copy of the draft → target table is made once per table, again when the table
    is replaced or written in place."""
    table = torch.arange(10) + 5
    first = target_list(table)
    assert first == list(range(5, 15)) and target_list(table) is first
    table[3] = 99
    assert target_list(table)[3] == 99
    other = torch.arange(10)
    assert target_list(other) == list(range(10))
    with torch.inference_mode():
        frozen = torch.arange(4) * 2  # an inference tensor: no version counter
    assert target_list(frozen) == [0, 2, 4, 6] and target_list(frozen) is target_list(frozen)


@pytest.mark.parametrize("lens", [[7], [6, 6], [3, 8]])
@pytest.mark.parametrize("additive", [False, True])
def test_tree_draft_attention_against_a_reference(lens: list[int], additive: bool) -> None:
    """TreeDraftAttention (one request, prefixes of one and of two lengths; the ancestors as
    bool or as the host tree's additive 0/-inf mask): each frontier query sees its request's
    prefix and its own ancestors, as plain softmax attention computes it, and bit for bit as
    SDPA computes it from a bool mask."""
    g = torch.Generator().manual_seed(3)
    h, hkv, hd, k, steps = 4, 2, 8, 3, 3
    k_pool, v_pool = (torch.randn(1, 40, hkv, hd, generator=g) for _ in range(2))
    slots = [torch.randperm(40, generator=g)[:n] for n in lens]
    b = len(lens)
    attn = TreeDraftAttention(k_pool, v_pool, h, slots, max_tree=steps * k)
    other = TreeDraftAttention(k_pool, v_pool, h, slots, max_tree=steps * k)  # the other kind
    tree_k: list[torch.Tensor] = []  # per step (B, K, Hkv, hd)
    tree_v: list[torch.Tensor] = []
    for step in range(1, steps + 1):
        anc = torch.rand(b, k, step * k, generator=g) < 0.5
        anc[:, :, -k:] = torch.eye(k, dtype=torch.bool)
        q = torch.randn(b * k, h, hd, generator=g)
        kn, vn = (torch.randn(b * k, hkv, hd, generator=g) for _ in range(2))
        add = torch.zeros(anc.shape).masked_fill(~anc, float("-inf"))
        attn.set_frontier(add if additive else anc)
        other.set_frontier(anc if additive else add)
        got = attn.run(0, q, kn, vn).view(b, k, h, hd)
        assert torch.equal(got, other.run(0, q, kn, vn).view(b, k, h, hd))
        tree_k.append(kn.view(b, k, hkv, hd))
        tree_v.append(vn.view(b, k, hkv, hd))
        # bit for bit SDPA over the same padded rows with the bool mask it was once handed
        lp = max(lens)
        pad = torch.stack([torch.cat([s, s.new_zeros(lp - len(s))]) for s in slots])
        keys4, vals4 = (torch.cat([pool[0, pad]] + trees, 1).transpose(1, 2)
                        for pool, trees in ((k_pool, tree_k), (v_pool, tree_v)))
        see4 = torch.cat([torch.arange(lp).expand(b, k, lp)
                          < torch.tensor(lens).view(b, 1, 1), anc], 2)
        want = F.scaled_dot_product_attention(q.view(b, k, h, hd).transpose(1, 2), keys4, vals4,
                                              attn_mask=see4.unsqueeze(1), enable_gqa=True)
        assert torch.equal(got, want.transpose(1, 2))
        for r in range(b):
            keys = torch.cat([k_pool[0, slots[r]]] + [t[r] for t in tree_k])  # (L, Hkv, hd)
            vals = torch.cat([v_pool[0, slots[r]]] + [t[r] for t in tree_v])
            see = torch.cat([torch.ones(k, lens[r], dtype=torch.bool), anc[r]], 1)
            for i in range(k):
                for head in range(h):
                    kv = head // (h // hkv)
                    s = keys[:, kv] @ q.view(b, k, h, hd)[r, i, head] / math.sqrt(hd)
                    w = torch.softmax(s.masked_fill(~see[i], float("-inf")), 0)
                    torch.testing.assert_close(got[r, i, head], w @ vals[:, kv])


def test_host_tree_refuses_a_non_cpu_tree() -> None:
    meta = torch.zeros(1, 8, device="meta")
    with pytest.raises(ValueError, match="CPU-only"):
        draft_tree_one(FakeDraft(uniform), meta, meta, 1, 3,  # type: ignore[arg-type]
                       [torch.arange(3)], meta, meta, 3, 2, 4, None)


def test_target_lists_cached_are_bounded() -> None:
    tables = [torch.arange(5) + i for i in range(10)]
    for t in tables:
        assert target_list(t) == t.tolist()
    assert len(host_tree._TARGET_LISTS) <= host_tree._MAX_TABLES


def test_tree_draft_attention_over_a_run_of_the_pool() -> None:
    """One request whose prefix and the room after it are one run of the pool: the buffer is
    a view (nothing gathered), every frontier's attention is bit for bit the gathered
    buffer's, and the tree's K/V land only in the room after the prefix."""
    g = torch.Generator().manual_seed(4)
    h, hkv, hd, k, steps, lo, n = 4, 2, 8, 3, 3, 5, 11
    k_pool, v_pool = (torch.randn(1, 40, hkv, hd, generator=g) for _ in range(2))
    k0, v0 = k_pool.clone(), v_pool.clone()
    run = TreeDraftAttention(k_pool, v_pool, h, (lo, n), max_tree=steps * k)
    gathered = TreeDraftAttention(k0.clone(), v0.clone(), h, [torch.arange(lo, lo + n)],
                                  max_tree=steps * k)
    assert run.k_buf.data_ptr() == k_pool[0, lo].data_ptr()
    for step in range(1, steps + 1):
        anc = torch.rand(1, k, step * k, generator=g) < 0.5
        anc[:, :, -k:] = torch.eye(k, dtype=torch.bool)
        q = torch.randn(k, h, hd, generator=g)
        kn, vn = (torch.randn(k, hkv, hd, generator=g) for _ in range(2))
        run.set_frontier(anc)
        gathered.set_frontier(anc)
        assert torch.equal(run.run(0, q, kn, vn), gathered.run(0, q, kn, vn))
    room = slice(lo + n, lo + n + steps * k)
    outside = torch.ones(40, dtype=torch.bool)
    outside[room] = False
    assert torch.equal(k_pool[0, outside], k0[0, outside])
    assert torch.equal(v_pool[0, outside], v0[0, outside])
    assert torch.equal(k_pool[0, room], gathered.k_buf[0, n:])
    with pytest.raises(ValueError, match="outside the pool"):
        TreeDraftAttention(k_pool, v_pool, h, (30, 5), max_tree=steps * k)
