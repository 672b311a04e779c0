"""EAGLE-2 dynamic tree building with hand-built log-probs (DESIGN.md §1).

A wrong tree never changes outputs (verification is lossless), it only lowers τ, so the
lossless suites cannot see it: these tests pin the exact node sets, scores, order, parents and
depths. Semantics: each step keeps the best K children of the frontier by cumulative
log-prob (ties: creation order); the tree keeps the best N−1 candidates overall, in creation
order (parents before children), plus the root.
"""

from __future__ import annotations

import math

import pytest
import torch

from workbench.speculative.tree import build_tree, expand, finish_tree, select_frontier

ln = math.log


def logp_row(probs: dict[int, float], vocab: int) -> list[float]:
    """Log-probs over ``vocab`` ids: the given ones, the rest sharing what is left evenly."""
    rest = [i for i in range(vocab) if i not in probs]
    left = (1.0 - sum(probs.values())) / max(len(rest), 1)
    return [ln(probs.get(i, left)) for i in range(vocab)]


def ancestors_or_self(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = parents[j]
    return mask


# ---- expand ----------------------------------------------------------------------------------


def test_expand_children_scores_and_layout() -> None:
    """Children of frontier node f occupy columns [f·K, (f+1)·K), best first; a child's score
    is its parent's plus its own log-prob."""
    frontier = torch.tensor([[-0.5, -1.0]])
    logp = torch.tensor([[logp_row({2: 0.6, 0: 0.3}, 4), logp_row({3: 0.5, 1: 0.4}, 4)]])
    ids, scores, lp = expand(frontier, logp, 2)
    assert ids.tolist() == [[2, 0, 3, 1]]
    assert lp[0].tolist() == pytest.approx([ln(0.6), ln(0.3), ln(0.5), ln(0.4)])
    assert scores[0].tolist() == pytest.approx(
        [-0.5 + ln(0.6), -0.5 + ln(0.3), -1.0 + ln(0.5), -1.0 + ln(0.4)])


def test_expand_clamps_positive_log_probs() -> None:
    """Rounding can push a near-certain token's log-prob above 0: clamped, so a child never
    outscores its parent (what build_tree's parents-kept argument relies on)."""
    logp = torch.tensor([[[1e-6, -3.0, -4.0]]])
    ids, scores, lp = expand(torch.tensor([[-2.0]]), logp, 2)
    assert ids.tolist() == [[0, 1]]
    assert lp.tolist() == [[0.0, -3.0]]
    assert scores.tolist() == [[-2.0, -5.0]]


def test_expand_batch_rows_are_independent() -> None:
    logp = torch.tensor([[logp_row({1: 0.7}, 3)], [logp_row({2: 0.9}, 3)]])
    ids, scores, _ = expand(torch.tensor([[0.0], [-1.0]]), logp, 1)
    assert ids.tolist() == [[1], [2]]
    assert scores[:, 0].tolist() == pytest.approx([ln(0.7), -1.0 + ln(0.9)])


# ---- select_frontier -------------------------------------------------------------------------


def test_select_frontier_best_k_ties_by_creation_order() -> None:
    scores = torch.tensor([[-1.0, -0.5, -0.5, -2.0, -0.1],
                           [-3.0, -3.0, -3.0, -3.0, -3.0]])
    assert select_frontier(scores, 3).tolist() == [[4, 1, 2], [0, 1, 2]]
    assert select_frontier(scores, 1).tolist() == [[4], [0]]


# ---- build_tree ------------------------------------------------------------------------------

# A K=2, S=3 draft over a 6-token draft vocabulary, candidates in creation order:
# depth 1 (children of the root), then the K² children of each step's frontier.
#   idx  path      log-prob  score
#   0    (1,)      ln .5     ln .5    = -0.693
#   1    (2,)      ln .3     ln .3    = -1.204
#   2    (1,3)     ln .7     ln .35   = -1.050  ┐ frontier of step 2 (best 2 of idx 2..5)
#   3    (1,4)     ln .2     ln .1    = -2.303  │
#   4    (2,5)     ln .9     ln .27   = -1.309  ┘
#   5    (2,0)     ln .05    ln .015  = -4.200
#   6    (1,3,4)   ln .8     ln .28   = -1.273
#   7    (1,3,2)   ln .1     ln .035  = -3.352
#   8    (2,5,1)   ln .5     ln .135  = -2.002
#   9    (2,5,3)   ln .4     ln .108  = -2.226
# N = 6 keeps the best 5: idx 0, 2, 1, 6, 4 — a depth-3 node outranks a depth-2 one — and
# lists them in creation order 0, 1, 2, 4, 6.
HAND = {
    "tokens": [1, 2, 3, 4, 5, 0, 4, 2, 1, 3],
    "parents": [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4],
    "logp": [ln(p) for p in (0.5, 0.3, 0.7, 0.2, 0.9, 0.05, 0.8, 0.1, 0.5, 0.4)],
}


def cumulative(logp: list[float], parents: list[int]) -> list[float]:
    """Score of each candidate: its log-prob plus its parent's score (parents come first)."""
    out: list[float] = []
    for lp, p in zip(logp, parents, strict=True):
        out.append(lp + (out[p] if p >= 0 else 0.0))
    return out


HAND["scores"] = cumulative(HAND["logp"], HAND["parents"])
HAND_TREE = {
    "tokens": [7, 1, 2, 3, 5, 4],
    "parents": [-1, 0, 0, 1, 2, 3],
    "depth": [0, 1, 1, 2, 2, 3],
    "scores": [0.0, ln(0.5), ln(0.3), ln(0.35), ln(0.27), ln(0.28)],
    "draft_probs": [1.0, 0.5, 0.3, 0.7, 0.9, 0.8],
}


def hand_tree(n: int = 6, prefix: int = 11) -> object:
    t = torch.tensor
    return build_tree(t([7]), t([HAND["tokens"]]), t([HAND["parents"]]),
                      t([HAND["scores"]], dtype=torch.float32),
                      t([HAND["logp"]], dtype=torch.float32), n, t([prefix]))


def test_build_tree_hand_case() -> None:
    tree = hand_tree()
    assert tree.num_nodes == 6
    assert tree.tokens.tolist() == [HAND_TREE["tokens"]]
    assert tree.parents.tolist() == [HAND_TREE["parents"]]
    assert tree.depth.tolist() == [HAND_TREE["depth"]]
    assert tree.positions.tolist() == [[11 + d for d in HAND_TREE["depth"]]]
    assert tree.scores[0].tolist() == pytest.approx(HAND_TREE["scores"], abs=1e-6)
    assert tree.draft_probs[0].tolist() == pytest.approx(HAND_TREE["draft_probs"], abs=1e-6)
    assert tree.mask[0].tolist() == ancestors_or_self(HAND_TREE["parents"])


@pytest.mark.parametrize(("n", "kept"), [(2, [0]), (3, [0, 2]), (4, [0, 1, 2]),
                                         (5, [0, 1, 2, 6]), (7, [0, 1, 2, 4, 6, 8]),
                                         (11, list(range(10)))])
def test_build_tree_budget_keeps_best_prefix_of_the_ranking(n: int, kept: list[int]) -> None:
    """Every budget keeps the best N−1 by score, listed in creation order, parents first."""
    tree = hand_tree(n)
    assert tree.tokens[0, 1:].tolist() == [HAND["tokens"][i] for i in kept]
    par = tree.parents[0].tolist()
    assert all(0 <= par[i] < i for i in range(1, n))
    for node, cand in enumerate(kept, start=1):  # each node's parent is its candidate's parent
        pc = HAND["parents"][cand]
        assert par[node] == (0 if pc < 0 else kept.index(pc) + 1)


def test_build_tree_ties_prefer_creation_order_and_keep_parents() -> None:
    """A child with log-prob 0 ties its parent; a stable ranking puts the (earlier) parent
    first, so a budget cut between equal scores never keeps a child without its parent."""
    t = torch.tensor
    tokens, parents = t([[10, 11, 12, 13]]), t([[-1, -1, 0, 1]])
    scores = t([[-1.0, -1.0, -1.0, -2.0]])  # candidate 2 = child of 0 with log-prob 0
    logp = t([[-1.0, -1.0, 0.0, -1.0]])
    tree = build_tree(t([5]), tokens, parents, scores, logp, 3, t([0]))
    assert tree.tokens.tolist() == [[5, 10, 11]]
    tree = build_tree(t([5]), tokens, parents, scores, logp, 4, t([0]))
    assert tree.tokens.tolist() == [[5, 10, 11, 12]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1]]
    assert tree.draft_probs[0].tolist() == [1.0, pytest.approx(math.exp(-1)),
                                            pytest.approx(math.exp(-1)), 1.0]


def test_build_tree_batch_rows_are_independent() -> None:
    """Row b of a batched build equals building row b alone (rows differ in ranking)."""
    t = torch.tensor
    sc = t([HAND["scores"]], dtype=torch.float32)
    other_scores = sc.clone()
    other_scores[0, 3] = -0.8  # (1,4) now ranks second: kept instead of (2,5)
    other_scores[0, 8] = other_scores[0, 9] = -9.0
    tok = t([HAND["tokens"]])
    par = t([HAND["parents"]])
    lp = t([HAND["logp"]], dtype=torch.float32)
    both = build_tree(t([7, 8]), tok.repeat(2, 1), par.repeat(2, 1), torch.cat([sc, other_scores]),
                      lp.repeat(2, 1), 6, t([11, 30]))
    for row, (s, root, prefix) in enumerate([(sc, 7, 11), (other_scores, 8, 30)]):
        one = build_tree(t([root]), tok, par, s, lp, 6, t([prefix]))
        for name in ("tokens", "parents", "depth", "positions", "mask", "scores", "draft_probs"):
            assert torch.equal(getattr(both, name)[row], getattr(one, name)[0]), name
    assert both.tokens[1].tolist() == [8, 1, 2, 3, 4, 4]  # idx 0, 1, 2, 3, 6
    assert both.parents[1].tolist() == [-1, 0, 0, 1, 1, 3]


def test_build_tree_rejects_a_kept_node_without_its_parent() -> None:
    """Scores that violate child ≤ parent (not a draft's) are caught, not silently built."""
    t = torch.tensor
    with pytest.raises(AssertionError, match="parent was not selected"):
        build_tree(t([0]), t([[1, 2]]), t([[-1, 0]]), t([[-3.0, -1.0]]), t([[-3.0, 2.0]]),
                   2, t([0]))


def test_finish_tree_depth_positions_mask() -> None:
    parents = [-1, 0, 1, 0, 3, 3, 2]
    b_parents = torch.tensor([parents, [-1, 0, 0, 0, 0, 0, 0]])
    tokens = torch.arange(14).view(2, 7)
    tree = finish_tree(tokens, b_parents, torch.zeros(2, 7), torch.ones(2, 7), torch.tensor([4, 9]))
    assert tree.depth.tolist() == [[0, 1, 2, 1, 2, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert tree.positions.tolist() == [[4, 5, 6, 5, 6, 6, 7], [9, 10, 10, 10, 10, 10, 10]]
    assert tree.mask[0].tolist() == ancestors_or_self(parents)
    assert tree.mask[1].tolist() == ancestors_or_self([-1, 0, 0, 0, 0, 0, 0])
