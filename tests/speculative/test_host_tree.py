"""The CPU one-request tree (``host_tree.draft_tree_one``) equals the tensor path field by
field: the same draft calls (tokens, positions, ancestors), the same tree, ties included."""

from __future__ import annotations

import math

import pytest
import torch
from speculative.test_drafter import (
    FakeDraft,
    encode,
    hand_dist,
    random_dist,
    run_draft,
)

from workbench.core import DraftTree
from workbench.speculative.drafter import draft_tree


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
    assert [c["paths"] for c in hf.calls] == [c["paths"] for c in tf.calls]
    assert [c["positions"] for c in hf.calls] == [c["positions"] for c in tf.calls]
    for a, b in zip(hf.calls, tf.calls, strict=True):
        assert torch.equal(a["anc"], b["anc"])


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
