"""Hand-built trees with known acceptance, shared by the trace tests."""

from __future__ import annotations

from workbench.trace import TreeBuilt, Verified


def tree_step1() -> tuple[TreeBuilt, Verified]:
    """K=2 tree of rid 7 at step 1; accepted path 0→1→3, bonus 99.

    node:   0   1   2   3   4   5   6
    parent: -1  0   0   1   1   2   3
    depth:  0   1   1   2   2   2   3
    """
    tree = TreeBuilt(
        step=1,
        rid=7,
        tokens=[10, 11, 12, 13, 14, 15, 16],
        parents=[-1, 0, 0, 1, 1, 2, 3],
        depth=[0, 1, 1, 2, 2, 2, 3],
        scores=[0.0, -0.1, -2.0, -0.3, -1.5, -2.5, -0.9],
        draft_probs=[1.0, 0.9, 0.1, 0.8, 0.2, 0.6, 0.5],
        t=1.0,
    )
    ver = Verified(
        step=1,
        rid=7,
        target_tokens=[11, 13, 30, 99, 40, 41, 42],
        target_probs=[1.0, 0.95, 0.01, 0.7, 0.1, 0.2, 0.3],
        accepted_path=[0, 1, 3],
        accepted_tokens=[11, 13, 99],
        accept_length=3,
        bonus_token=99,
        t=1.1,
    )
    return tree, ver


def tree_step2() -> tuple[TreeBuilt, Verified]:
    """Chain of rid 7 at step 2 (topk=1); nothing accepted, bonus 5."""
    tree = TreeBuilt(
        step=2,
        rid=7,
        tokens=[99, 20, 21],
        parents=[-1, 0, 1],
        depth=[0, 1, 2],
        scores=[0.0, -0.5, -1.0],
        draft_probs=[1.0, 0.6, 0.6],
        t=2.0,
    )
    ver = Verified(
        step=2,
        rid=7,
        target_tokens=[5, 6, 7],
        target_probs=[1.0, 0.05, 0.5],
        accepted_path=[0],
        accepted_tokens=[5],
        accept_length=1,
        bonus_token=5,
        t=2.1,
    )
    return tree, ver


def unverified_tree() -> TreeBuilt:
    """A tree of rid 8 at step 3 whose Verified never came (e.g. the request was aborted)."""
    return TreeBuilt(
        step=3,
        rid=8,
        tokens=[1, 2],
        parents=[-1, 0],
        depth=[0, 1],
        scores=[0.0, -0.2],
        draft_probs=[1.0, 0.8],
        t=3.0,
    )
