"""greedy_accept: reference vs brute force over all root-to-node paths, Triton vs reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from kernel_cases import DEVICE, FAST, TRITON, brute_force_greedy, random_parents, tree_batches

from workbench.kernels import reference

Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _assert_brute_force(cand: torch.Tensor, parents: torch.Tensor, predict: torch.Tensor,
                        got: Result) -> None:
    index, length, bonus = (x.cpu() for x in got)
    for b in range(cand.shape[0]):
        path, want_bonus = brute_force_greedy(cand[b].tolist(), parents[b].tolist(),
                                              predict[b].tolist())
        n = cand.shape[1]
        assert index[b].tolist() == path + [-1] * (n - len(path)), f"row {b}"
        assert int(length[b]) == len(path) - 1, f"row {b}"
        assert int(bonus[b]) == want_bonus, f"row {b}"


def _assert_equal(got: Result, want: Result) -> None:
    for name, g, w in zip(("accept_index", "accept_len", "bonus"), got, want, strict=True):
        assert g.dtype == torch.int64, name
        assert torch.equal(g.cpu(), w.cpu()), f"{name}: {g.tolist()} != {w.tolist()}"


@FAST
@given(batch=tree_batches(max_batch=5, max_nodes=20))
def test_reference_equals_brute_force(batch: tuple[torch.Tensor, ...]) -> None:
    cand, parents, predict = batch
    _assert_brute_force(cand, parents, predict, reference.greedy_accept(cand, parents, predict))


@FAST
@given(batch=tree_batches(max_batch=5, max_nodes=20))
def test_cpu_walk_equals_reference(batch: tuple[torch.Tensor, ...]) -> None:
    """The CPU dispatch (a Python walk) returns exactly the reference's tensors."""
    cand, parents, predict = batch
    _assert_equal(reference.greedy_accept_walk(cand, parents, predict),
                  reference.greedy_accept(cand, parents, predict))
    # its host lists (what the engine's commit reads) are those tensors' values, whether it
    # read the tree from the tensors or was handed the tree's own host lists
    for lists in (None, (cand.tolist(), parents.tolist())):
        (idx, n, bonus), host = reference.greedy_accept_host(cand, parents, predict, lists)
        assert host == (idx.tolist(), n.tolist(), bonus.tolist(), cand.tolist())


@TRITON
@given(batch=tree_batches(max_batch=4, max_nodes=24))
def test_triton_equals_reference_hypothesis(batch: tuple[torch.Tensor, ...],
                                            triton_ready: None) -> None:
    from workbench.kernels.triton_greedy_accept import greedy_accept_triton

    cand, parents, predict = (x.to(DEVICE) for x in batch)
    _assert_equal(greedy_accept_triton(cand, parents, predict),
                  reference.greedy_accept(cand, parents, predict))


def _sized_batch(batch: int, nodes: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random trees of every shape; predictions copy a child's token 60% of the time."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ("random", "chain", "star", "wide")
    parents = torch.tensor([random_parents(nodes, gen, shapes[b % 4]) for b in range(batch)])
    cand = torch.randint(0, 50, (batch, nodes), generator=gen)
    predict = torch.randint(0, 50, (batch, nodes), generator=gen)
    for b in range(batch):
        for n in range(nodes):
            kids = (parents[b] == n).nonzero().flatten()
            if kids.numel() and bool(torch.rand(1, generator=gen) < 0.6):
                pick = kids[torch.randint(0, kids.numel(), (1,), generator=gen)]
                predict[b, n] = cand[b, pick]
    return cand, parents, predict


@pytest.mark.parametrize("nodes", [1, 6, 16, 64])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_triton_equals_reference_sizes(batch: int, nodes: int, triton_ready: None) -> None:
    from workbench.kernels.triton_greedy_accept import greedy_accept_triton

    cand, parents, predict = _sized_batch(batch, nodes, seed=batch * 100 + nodes)
    want = reference.greedy_accept(cand, parents, predict)
    _assert_brute_force(cand, parents, predict, want)
    got = greedy_accept_triton(*(x.to(DEVICE) for x in (cand, parents, predict)))
    _assert_equal(got, want)


def _hand_cases() -> list[tuple[str, list[int], list[int], list[int], list[int], int]]:
    """(id, candidates, parents, predict, expected path, expected bonus)."""
    return [
        # chain, every draft right: accept all, bonus = prediction at the leaf
        ("accept-all", [7, 1, 2, 3], [-1, 0, 1, 2], [1, 2, 3, 9], [0, 1, 2, 3], 9),
        # no child matches: only the root, bonus = prediction at the root
        ("reject-all", [7, 1, 2, 3], [-1, 0, 0, 0], [5, 0, 0, 0], [0], 5),
        # two siblings carry the right token: the lower index wins even though the other
        # one would lead to a longer path
        ("first-sibling-wins", [7, 4, 4, 8], [-1, 0, 0, 2], [4, 0, 8, 0], [0, 1], 0),
        # the path runs through the second child of the root, three levels deep
        ("deep", [0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 2, 4], [2, 9, 4, 9, 5, 6], [0, 2, 4, 5], 6),
        ("root-only", [3], [-1], [8], [0], 8),
    ]


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("case", _hand_cases(), ids=[c[0] for c in _hand_cases()])
def test_hand_built_trees(case: tuple, use_triton: bool, request: pytest.FixtureRequest) -> None:
    _, cand, parents, predict, path, bonus = case
    if use_triton:
        request.getfixturevalue("triton_ready")
        from workbench.kernels.triton_greedy_accept import greedy_accept_triton as fn
    else:
        fn = reference.greedy_accept
    index, length, got_bonus = fn(*(torch.tensor([x], device=DEVICE)
                                    for x in (cand, parents, predict)))
    assert index[0].tolist() == path + [-1] * (len(cand) - len(path))
    assert int(length[0]) == len(path) - 1
    assert int(got_bonus[0]) == bonus


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_bad_arguments(use_triton: bool, request: pytest.FixtureRequest) -> None:
    if use_triton:
        request.getfixturevalue("triton_ready")
        from workbench.kernels.triton_greedy_accept import greedy_accept_triton as fn
    else:
        fn = reference.greedy_accept
    cand = torch.zeros(2, 3, dtype=torch.int64)
    parents = torch.tensor([[-1, 0, 1]] * 2)
    with pytest.raises(ValueError, match="candidates must have dtype"):
        fn(cand.int(), parents, cand)
    with pytest.raises(ValueError, match="parents must have shape"):
        fn(cand, parents[:1], cand)
    with pytest.raises(ValueError, match="target_predict must have shape"):
        fn(cand, parents, cand[:, :2])
    with pytest.raises(ValueError, match="candidates must be 2-D"):
        fn(cand[0], parents[0], cand[0])


def test_reference_checks_tree_invariants() -> None:
    cand = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"parents\[:, 0\] must be -1"):
        reference.greedy_accept(cand, torch.tensor([[0, 0, 1]]), cand)
    with pytest.raises(ValueError, match=r"parents\[0, 2\] = 2"):
        reference.greedy_accept(cand, torch.tensor([[-1, 0, 2]]), cand)
