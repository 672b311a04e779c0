"""tree_speculative_sample: the reference against the rule as worded (a per-row walk), Triton
against the reference, and losslessness by empirical frequencies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_cases import (
    DEVICE,
    FAST,
    TRITON,
    check_distribution,
    random_parents,
    spec_walk_sample,
    tree_probs,
)

from workbench.kernels import reference

Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _assert_equal(got: Result, want: Result) -> None:
    for name, g, w in zip(("accept_index", "accept_len", "bonus"), got, want, strict=True):
        assert g.dtype == torch.int64, name
        assert torch.equal(g.cpu(), w.cpu()), f"{name}: {g.tolist()} != {w.tolist()}"


def _inputs(parents: torch.Tensor, vocab: int, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    batch, nodes = parents.shape
    cand = torch.randint(0, vocab, (batch, nodes), generator=gen)
    probs = tree_probs(cand, parents, vocab, gen)
    coins = torch.rand(batch, nodes, generator=gen)
    final_u = torch.rand(batch, generator=gen)
    return cand, parents, probs, coins, final_u


@st.composite
def sample_problems(draw: st.DrawFn, max_batch: int, max_nodes: int, max_vocab: int) -> Inputs:
    batch = draw(st.integers(1, max_batch))
    nodes = draw(st.integers(1, max_nodes))
    parents = torch.tensor([[-1] + [draw(st.integers(0, i - 1)) for i in range(1, nodes)]
                            for _ in range(batch)])
    vocab = draw(st.integers(1, max_vocab))
    return _inputs(parents, vocab, seed=draw(st.integers(0, 2**31 - 1)))


def _check_invariants(inputs: Inputs, got: Result) -> None:
    """Path follows parent links; the bonus has residual mass (never a rejected child's token)."""
    cand, parents, probs, _, _ = inputs
    index, length, bonus = (x.cpu() for x in got)
    for b in range(cand.shape[0]):
        path = index[b, : int(length[b]) + 1].tolist()
        assert path[0] == 0 and all(v == -1 for v in index[b, len(path):].tolist())
        assert all(int(parents[b, w]) == u for u, w in zip(path, path[1:], strict=False))
        last = path[-1]
        kids = (parents[b] == last).nonzero().flatten()
        rejected = set(cand[b, kids].tolist())
        residual = probs[b, last].clone()
        residual[list(rejected)] = 0.0
        if float(residual.sum()) > 0:
            assert float(residual[int(bonus[b])]) > 0, f"row {b}: bonus outside the residual"


@FAST
@given(inputs=sample_problems(max_batch=4, max_nodes=12, max_vocab=12))
def test_reference_equals_spec_walk(inputs: Inputs) -> None:
    got = reference.tree_speculative_sample(*inputs)
    _assert_equal(got, spec_walk_sample(*inputs))
    _check_invariants(inputs, got)


@TRITON
@given(inputs=sample_problems(max_batch=3, max_nodes=20, max_vocab=300))
def test_triton_equals_reference_hypothesis(inputs: Inputs, triton_ready: None) -> None:
    from workbench.kernels.triton_tree_sample import tree_speculative_sample_triton

    want = reference.tree_speculative_sample(*inputs)
    _assert_equal(tree_speculative_sample_triton(*(x.to(DEVICE) for x in inputs)), want)


@pytest.mark.parametrize("nodes", [1, 6, 16, 64])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_triton_equals_reference_sizes(batch: int, nodes: int, triton_ready: None) -> None:
    from workbench.kernels.triton_tree_sample import tree_speculative_sample_triton

    gen = torch.Generator().manual_seed(batch * 1000 + nodes)
    shapes = ("random", "chain", "star", "wide")
    parents = torch.tensor([random_parents(nodes, gen, shapes[b % 4]) for b in range(batch)])
    vocab = (7, 111, 1000)[(batch + nodes) % 3]  # 1000 spans several vocab blocks at N=64
    inputs = _inputs(parents, vocab, seed=batch + nodes)
    want = reference.tree_speculative_sample(*inputs)
    _check_invariants(inputs, want)
    _assert_equal(tree_speculative_sample_triton(*(x.to(DEVICE) for x in inputs)), want)


def test_triton_large_vocab_multiblock(triton_ready: None) -> None:
    """V = 5000 (3 vocab blocks at N = 6), rejected tokens in different blocks."""
    from workbench.kernels.triton_tree_sample import tree_speculative_sample_triton

    parents = torch.tensor([[-1, 0, 0, 0, 1, 1]] * 3)
    cand, _, probs, coins, final_u = _inputs(parents, 5000, seed=3)
    cand[:, 1:4] = torch.tensor([17, 2500, 4999])
    probs[:, 0] = 0.0
    probs[:, 0, [17, 2500, 4999, 4000]] = torch.tensor([0.2, 0.3, 0.1, 0.4])
    coins[:, 1:4] = 0.99  # reject all three: the bonus must be 4000
    inputs = (cand, parents, probs, coins, final_u)
    want = reference.tree_speculative_sample(*inputs)
    assert want[2].tolist() == [4000] * 3 and want[1].tolist() == [0] * 3
    _assert_equal(tree_speculative_sample_triton(*(x.to(DEVICE) for x in inputs)), want)


def test_u_near_one_gives_last_nonzero_token() -> None:
    """final_u just below 1: the last token with mass, whether or not round-off kicks in."""
    probs = torch.zeros(1, 1, 5)
    probs[0, 0, [1, 3]] = torch.tensor([1 / 3, 2 / 3])
    got = reference.tree_speculative_sample(torch.zeros(1, 1, dtype=torch.int64),
                                            torch.tensor([[-1]]), probs, torch.zeros(1, 1),
                                            torch.tensor([0.99999994]))
    assert int(got[2][0]) == 3


# ---------------------------------------------------------------- losslessness


# A fixed tree: root with children 1 (token 0), 2 (token 2), 3 (token 2, a duplicate), 4 (token 5);
# node 1 has children 5 (token 1) and 6 (token 3); node 2 has child 7 (token 4).
DIST_PARENTS = [-1, 0, 0, 0, 0, 1, 1, 2]
DIST_TOKENS = [9, 0, 2, 2, 5, 1, 3, 4]
DIST_VOCAB = 6


def _dist_problem(trials: int, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    nodes = len(DIST_PARENTS)
    base = torch.rand(nodes, DIST_VOCAB, generator=gen) + 0.3
    base[0, 4] = 0.0  # a token the target never emits at the root
    base[1] = torch.tensor([0.0, 0.5, 0.1, 0.3, 0.0, 0.1])
    probs = (base / base.sum(-1, keepdim=True)).expand(trials, -1, -1).contiguous()
    cand = torch.tensor(DIST_TOKENS).expand(trials, -1).contiguous()
    parents = torch.tensor(DIST_PARENTS).expand(trials, -1).contiguous()
    coins = torch.rand(trials, nodes, generator=gen)
    final_u = torch.rand(trials, generator=gen)
    return cand, parents, probs, coins, final_u


def _emitted(inputs: Inputs, got: Result) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First and second emitted tokens of each trial (second = -1 if the step emitted one)."""
    cand = inputs[0]
    index, length, bonus = (x.cpu() for x in got)
    rows = torch.arange(cand.shape[0])
    first = torch.where(length >= 1, cand[rows, index[:, 1].clamp_min(0)], bonus)
    second = torch.where(length >= 2, cand[rows, index[:, 2].clamp_min(0)], bonus)
    second = torch.where(length >= 1, second, -1)
    return first, second, index[:, 1]


def _check_lossless(inputs: Inputs, got: Result) -> None:
    probs = inputs[2][0]
    first, second, node1 = _emitted(inputs, got)
    check_distribution(torch.bincount(first, minlength=DIST_VOCAB), probs[0], "first token")
    # Given the first token came from child c, the next token must follow target_probs[c].
    for c in (1, 2):
        sel = node1 == c
        check_distribution(torch.bincount(second[sel], minlength=DIST_VOCAB), probs[c],
                           f"second token after node {c}")


def test_reference_is_lossless() -> None:
    inputs = _dist_problem(trials=40_000, seed=0)
    _check_lossless(inputs, reference.tree_speculative_sample(*inputs))


def test_triton_is_lossless(triton_ready: None) -> None:
    """Fewer trials under the interpreter (~ms per program); the equality tests carry the rest."""
    from workbench.kernels.triton_tree_sample import tree_speculative_sample_triton

    trials = 40_000 if DEVICE.type == "cuda" else 500
    inputs = _dist_problem(trials=trials, seed=1)
    _check_lossless(inputs, tree_speculative_sample_triton(*(x.to(DEVICE) for x in inputs)))


def test_distribution_check_rejects_a_biased_sampler() -> None:
    """The statistical check has power: greedy-biased first tokens fail it."""
    inputs = _dist_problem(trials=40_000, seed=0)
    probs = inputs[2][0, 0]
    biased = torch.multinomial(probs ** 1.5, 40_000, replacement=True,
                               generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError):
        check_distribution(torch.bincount(biased, minlength=DIST_VOCAB), probs, "biased")


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_bad_arguments(use_triton: bool, request: pytest.FixtureRequest) -> None:
    if use_triton:
        request.getfixturevalue("triton_ready")
        from workbench.kernels.triton_tree_sample import tree_speculative_sample_triton as fn
    else:
        fn = reference.tree_speculative_sample
    cand, parents, probs, coins, final_u = _inputs(torch.tensor([[-1, 0, 0]] * 2), 5, seed=0)
    with pytest.raises(ValueError, match="target_probs must have dtype"):
        fn(cand, parents, probs.double(), coins, final_u)
    with pytest.raises(ValueError, match="target_probs must have shape"):
        fn(cand, parents, probs[:, :2], coins, final_u)
    with pytest.raises(ValueError, match="coins must have shape"):
        fn(cand, parents, probs, coins[:, :2], final_u)
    with pytest.raises(ValueError, match="final_u must have dtype"):
        fn(cand, parents, probs, coins, final_u.double())
    with pytest.raises(ValueError, match="parents must have dtype"):
        fn(cand, parents.int(), probs, coins, final_u)


def test_reference_checks_token_range() -> None:
    cand, parents, probs, coins, final_u = _inputs(torch.tensor([[-1, 0, 0]]), 5, seed=0)
    cand[0, 2] = 5
    with pytest.raises(ValueError, match=r"candidates\[:, 1:\]"):
        reference.tree_speculative_sample(cand, parents, probs, coins, final_u)
