"""``draft_tree`` against a fake draft whose distributions are hand-built per tree path.

The fake draft reads the path of the node it is fed from its input (the parent's hidden state
carries the request and the path so far, the input token adds the node itself), so its logits
are a function of the exact path. That lets the tests check what ``draft_tree`` feeds the draft
(token, parent hidden state, position, tree-attention ancestors) and the tree it builds, against
the hand case of test_tree.py and against a plain-Python EAGLE-2 reference (DESIGN.md §1).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from workbench.core import DraftTree
from workbench.speculative.drafter import draft_tree

D2T = 1000  # target id = draft id + D2T
MAX_DEPTH = 8
Dist = Callable[[int, tuple[int, ...]], list[float]]  # (request, path) → draft-vocab probs


class FakeDraft:
    """Hidden state (D = 1 + MAX_DEPTH): [request, path…, -1 padding]."""

    def __init__(self, dist: Dist) -> None:
        self.dist = dist
        self.config = SimpleNamespace(num_attention_heads=1)
        self.calls: list[dict[str, object]] = []

    def target_ids(self) -> torch.Tensor:
        """Every draft id's target id (a table longer than any vocab these tests use)."""
        return torch.arange(1 << 14) + D2T

    def __call__(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 attn: object) -> tuple[torch.Tensor, torch.Tensor]:
        rows, outs, paths = [], [], []
        for tok, h in zip(tokens.tolist(), hidden.tolist(), strict=True):
            req = int(h[0])
            path = tuple(int(x) for x in h[1:] if x >= 0) + (tok - D2T,)
            paths.append((req, path))
            rows.append([math.log(p) for p in self.dist(req, path)])
            outs.append(encode(req, path))
        self.calls.append({"paths": paths, "positions": positions.tolist(),
                           "anc": attn.anc.clone()})
        return torch.tensor(rows), torch.tensor(outs)


def encode(req: int, path: tuple[int, ...]) -> list[float]:
    return [float(req)] + [float(x) for x in path] + [-1.0] * (MAX_DEPTH - len(path))


def run_draft(dist: Dist, batch: int, steps: int, topk: int, n: int,
              root_pos: list[int], temperature: list[float] | None = None,
              on_step: object = None) -> tuple[DraftTree, FakeDraft]:
    fake = FakeDraft(dist)
    logits0 = torch.tensor([[math.log(p) for p in dist(b, ())] for b in range(batch)])
    hidden0 = torch.tensor([encode(b, ()) for b in range(batch)])
    pool = torch.zeros(1, 64, 1, 2)
    prefix = [torch.arange(p) for p in root_pos]
    temp = None if temperature is None else torch.tensor(temperature)
    roots = torch.tensor([7 + b for b in range(batch)])
    tree = draft_tree(fake, logits0, hidden0, roots, torch.tensor(root_pos),  # type: ignore[arg-type]
                      prefix, pool, pool.clone(), steps, topk, n,
                      on_step=on_step, score_temperature=temp)
    return tree, fake


def reference(dist: Dist, req: int, steps: int, topk: int, n: int,
              temperature: float = 1.0) -> dict[str, list]:
    """EAGLE-2 in plain Python: best K frontier by cumulative log-prob (ties: creation order),
    best N−1 candidates overall in creation order, root first."""

    def top(path: tuple[int, ...]) -> list[tuple[int, float]]:
        logits = [math.log(p) / temperature for p in dist(req, path)]
        z = math.log(sum(math.exp(x) for x in logits))
        lp = [x - z for x in logits]
        return sorted(enumerate(lp), key=lambda x: -x[1])[:topk]

    cands: list[tuple[tuple[int, ...], float, float, int]] = []  # path, score, logp, parent
    for tok, lp in top(()):
        cands.append(((tok,), lp, lp, -1))
    frontier = list(range(len(cands)))
    for _ in range(1, steps):
        children = []
        for f in frontier:
            path, score = cands[f][0], cands[f][1]
            children += [(path + (tok,), score + lp, lp, f) for tok, lp in top(path)]
        base = len(cands)
        cands += children
        best = sorted(range(len(children)), key=lambda i: (-children[i][1], i))[:topk]
        frontier = [base + i for i in best]
    ranked = sorted(range(len(cands)), key=lambda i: (-cands[i][1], i))
    kept = sorted(ranked[: n - 1])
    node = {c: i + 1 for i, c in enumerate(kept)}
    return {"paths": [()] + [cands[c][0] for c in kept],
            "tokens": [7 + req] + [cands[c][0][-1] + D2T for c in kept],
            "parents": [-1] + [node.get(cands[c][3], 0) for c in kept],
            "scores": [0.0] + [cands[c][1] for c in kept],
            "probs": [1.0] + [math.exp(cands[c][2]) for c in kept],
            "cut_gap": [cands[ranked[n - 2]][1] - cands[ranked[n - 1]][1]] if len(cands) >= n
            else [math.inf]}


# The hand case of test_tree.py (K=2, S=3, N=6), written as distributions per path.
HAND: dict[tuple[int, ...], dict[int, float]] = {
    (): {1: 0.5, 2: 0.3},
    (1,): {3: 0.7, 4: 0.2},
    (2,): {5: 0.9, 0: 0.05},
    (1, 3): {4: 0.8, 2: 0.1},
    (2, 5): {1: 0.5, 3: 0.4},
}
VOCAB = 6


def spread(probs: dict[int, float], vocab: int = VOCAB) -> list[float]:
    rest = [i for i in range(vocab) if i not in probs]
    left = (1.0 - sum(probs.values())) / len(rest)
    return [probs.get(i, left) for i in range(vocab)]


def hand_dist(req: int, path: tuple[int, ...]) -> list[float]:
    """Request 0: the hand case; request 1: the same with draft ids reversed (5 − id)."""
    if req == 1:
        flipped = hand_dist(0, tuple(VOCAB - 1 - t for t in path))
        return flipped[::-1]
    return spread(HAND.get(path, {0: 0.4, 1: 0.3}))


def random_dist(seed: int, vocab: int) -> Dist:
    cache: dict[tuple[int, tuple[int, ...]], list[float]] = {}

    def dist(req: int, path: tuple[int, ...]) -> list[float]:
        if (req, path) not in cache:
            rng = random.Random(f"{seed}/{req}/{path}")
            # peaked (a few likely tokens), so the best N−1 reach deep into the tree
            w = [rng.random() ** 14 + 1e-3 for _ in range(vocab)]
            cache[(req, path)] = [x / sum(w) for x in w]
        return cache[(req, path)]

    return dist


def test_hand_case_tree() -> None:
    tree, fake = run_draft(hand_dist, 1, 3, 2, 6, [11])
    t = tree
    assert t.tokens.tolist() == [[7, 1001, 1002, 1003, 1005, 1004]]
    assert t.parents.tolist() == [[-1, 0, 0, 1, 2, 3]]
    assert t.depth.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert t.positions.tolist() == [[11, 12, 12, 13, 13, 14]]
    assert t.scores[0].tolist() == pytest.approx(
        [0.0] + [math.log(p) for p in (0.5, 0.3, 0.35, 0.27, 0.28)], abs=1e-5)
    assert t.draft_probs[0].tolist() == pytest.approx(
        [1.0, 0.5, 0.3, 0.7, 0.9, 0.8], abs=1e-5)
    # S−1 = 2 draft forwards: the depth-1 frontier, then the best 2 of its 4 children
    assert [c["paths"] for c in fake.calls] == [[(0, (1,)), (0, (2,))],
                                                [(0, (1, 3)), (0, (2, 5))]]
    # a node at depth d is fed at position root_pos − 1 + d (its parent's position + 1)
    assert [c["positions"] for c in fake.calls] == [[11, 11], [12, 12]]


@pytest.mark.parametrize("case", ["hand", "random"])
def test_tree_attention_sees_each_frontier_nodes_ancestors(case: str) -> None:
    """Step s feeds K nodes; tree-attention entry j (the j-th node fed so far) is visible to a
    node iff it is the node itself or one of its ancestors. (The random case has frontiers
    whose parents are permuted or shared, where a wrong ancestor gather shows.)"""
    dist, batch, k = (hand_dist, 2, 2) if case == "hand" else (random_dist(7, 23), 3, 3)
    _, fake = run_draft(dist, batch, 5, k, 12, [5, 9, 2][:batch])
    fed: list[list[tuple[int, ...]]] = [[] for _ in range(batch)]
    for call in fake.calls:
        paths = call["paths"]
        anc = call["anc"]
        assert isinstance(paths, list) and isinstance(anc, torch.Tensor)
        for req, path in paths:
            fed[req].append(path)
        for row, (req, path) in enumerate(paths):
            want = [p == path[: len(p)] for p in fed[req]]
            assert anc[req, row % k].tolist() == want, (req, path)


def test_batch_rows_draft_independently() -> None:
    tree, _ = run_draft(hand_dist, 2, 3, 2, 6, [11, 20])
    t = tree
    for req in (0, 1):
        ref = reference(hand_dist, req, 3, 2, 6)
        assert t.tokens[req].tolist() == ref["tokens"]
        assert t.parents[req].tolist() == ref["parents"]
    assert t.tokens[1, 1:].tolist() == [1004, 1003, 1002, 1000, 1001]


def test_topk_1_is_the_greedy_chain() -> None:
    """topk = 1: every step follows the draft's argmax; N = S + 1 nodes in a chain."""
    tree, fake = run_draft(hand_dist, 1, 4, 1, 5, [3])
    t = tree
    # argmax path: 1 (.5) → 3 (.7) → 4 (.8) → 0 (.4, the default distribution)
    assert t.tokens.tolist() == [[7, 1001, 1003, 1004, 1000]]
    assert t.parents.tolist() == [[-1, 0, 1, 2, 3]]
    assert t.depth.tolist() == [[0, 1, 2, 3, 4]]
    assert t.scores[0].tolist() == pytest.approx(
        [0.0, math.log(0.5), math.log(0.35), math.log(0.28), math.log(0.112)], abs=1e-5)
    assert [c["paths"] for c in fake.calls] == [[(0, (1,))], [(0, (1, 3))], [(0, (1, 3, 4))]]


def test_on_step_reports_every_depth() -> None:
    seen: list[tuple[int, list[list[int]], list[list[int]]]] = []

    def on_step(depth: int, tokens: torch.Tensor, probs: torch.Tensor,
                parents: torch.Tensor) -> None:
        assert probs.shape == tokens.shape == parents.shape
        seen.append((depth, tokens.tolist(), parents.tolist()))

    run_draft(hand_dist, 1, 3, 2, 6, [11], on_step=on_step)
    assert [d for d, _, _ in seen] == [1, 2, 3]
    assert seen[0][1:] == ([[1001, 1002]], [[-1, -1]])
    # step 2: the K² children of frontier candidates 0, 1 (parents = candidate indices)
    assert seen[1][1:] == ([[1003, 1004, 1005, 1000]], [[0, 0, 1, 1]])
    # step 3: children of candidates 2 ((1,3)) and 4 ((2,5))
    assert seen[2][1:] == ([[1004, 1002, 1001, 1003]], [[2, 2, 4, 4]])


@pytest.mark.parametrize(("steps", "topk", "n"), [(4, 3, 10), (5, 4, 16), (3, 2, 7), (6, 8, 32),
                                                  (2, 4, 9)])
@pytest.mark.parametrize("temperature", [None, 2.5])
def test_matches_reference_on_random_distributions(steps: int, topk: int, n: int,
                                                   temperature: float | None) -> None:
    dist = random_dist(steps * 100 + topk * 10 + n, vocab=23)
    batch = 3
    temps = None if temperature is None else [temperature, 1.0, 0.5]
    tree, _ = run_draft(dist, batch, steps, topk, n, [4, 17, 9], temperature=temps)
    t = tree
    depths = []
    for req in range(batch):
        ref = reference(dist, req, steps, topk, n, 1.0 if temps is None else temps[req])
        depths.append(max(len(p) for p in ref["paths"]))
        assert ref["cut_gap"][0] > 1e-4, "near-tie at the budget cut: pick another seed"
        assert t.tokens[req].tolist() == ref["tokens"], req
        assert t.parents[req].tolist() == ref["parents"], req
        assert t.depth[req].tolist() == [len(p) for p in ref["paths"]]
        assert t.scores[req].tolist() == pytest.approx(ref["scores"], abs=1e-4)
        assert t.draft_probs[req].tolist() == pytest.approx(ref["probs"], abs=1e-5)
    assert max(depths) >= min(steps, 3), "the trees never get deep: the case tests little"
