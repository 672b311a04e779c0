"""Input builders and oracles shared by the kernel tests (paged layouts, trees, distributions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Interpreted Triton takes ~ms per program: no deadline, few examples, reproducible runs, and no
# .hypothesis/ database written into the work tree.
FAST = settings(deadline=None, database=None, derandomize=True, max_examples=200,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TRITON = settings(FAST, max_examples=30)

TOL: dict[torch.dtype, dict[str, Any]] = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
       torch.float16: {"atol": 1e-3, "rtol": 1e-3},
       torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}


# ---------------------------------------------------------------- trees


def random_parents(nodes: int, gen: torch.Generator, shape: str = "random") -> list[int]:
    """parents[0] = -1 and parents[i] < i. shape: random | chain | star | wide."""
    if shape == "chain":
        return [-1] + list(range(nodes - 1))
    if shape == "star":
        return [-1] + [0] * (nodes - 1)
    if shape == "wide":  # EAGLE-like: a few children per node, breadth first
        return [-1] + [(i - 1) // 3 for i in range(1, nodes)]
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]


def ancestor_closure(parents: list[int]) -> torch.Tensor:
    """(N, N) bool: [i, j] = j is i or an ancestor of i."""
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            out[i, j] = True
            j = parents[j]
    return out


def root_paths(parents: list[int]) -> list[list[int]]:
    """Every root-to-node path, one per node."""
    paths = []
    for v in range(len(parents)):
        path = [v]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def brute_force_greedy(cand: list[int], parents: list[int], predict: list[int]
                       ) -> tuple[list[int], int]:
    """Greedy acceptance by enumeration of all root-to-node paths.

    A path is consistent when each step goes to the *first* child (by index) whose token equals
    the target's prediction at the step's parent. Consistent paths are nested; the accepted one is
    the longest. Returns (path, bonus).
    """
    def first_match(u: int) -> int | None:
        kids = [c for c in range(len(parents)) if parents[c] == u and cand[c] == predict[u]]
        return kids[0] if kids else None

    best: list[int] = [0]
    for path in root_paths(parents):
        if all(first_match(u) == w for u, w in zip(path, path[1:], strict=False)):
            if len(path) > len(best):
                best = path
    return best, predict[best[-1]]


@st.composite
def tree_batches(draw: st.DrawFn, max_batch: int = 4, max_nodes: int = 16, vocab: int = 3
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(candidates, parents, target_predict), each (B, N) int64, over a tiny vocab (many hits)."""
    batch = draw(st.integers(1, max_batch))
    nodes = draw(st.integers(1, max_nodes))
    parents = [[-1] + [draw(st.integers(0, i - 1)) for i in range(1, nodes)]
               for _ in range(batch)]
    tokens = st.lists(st.integers(0, vocab - 1), min_size=nodes, max_size=nodes)
    cand = [draw(tokens) for _ in range(batch)]
    predict = [draw(tokens) for _ in range(batch)]
    return (torch.tensor(cand), torch.tensor(parents), torch.tensor(predict))


def tree_probs(cand: torch.Tensor, parents: torch.Tensor, vocab: int, gen: torch.Generator
               ) -> torch.Tensor:
    """(B, N, V) float32 target distributions that make acceptance interesting.

    Mixes dense rows, sparse top-k-like rows (exact zeros) and one-hot rows, and puts extra mass
    on the tokens of each node's children so that accepts, rejects and deep paths all occur.
    """
    batch, nodes = cand.shape
    logits = torch.randn(batch, nodes, vocab, generator=gen)
    probs = torch.softmax(logits, dim=-1)
    for b in range(batch):
        for n in range(nodes):
            kids = (parents[b] == n).nonzero().flatten().tolist()
            for c in kids:
                probs[b, n, cand[b, c]] += 3.0 * float(torch.rand(1, generator=gen)) / len(kids)
            kind = int(torch.randint(0, 4, (1,), generator=gen))
            if kind == 1:  # sparse: keep the top few tokens only
                k = int(torch.randint(1, min(vocab, 4) + 1, (1,), generator=gen))
                top = probs[b, n].topk(k).indices
                keep = torch.zeros(vocab, dtype=torch.bool)
                keep[top] = True
                probs[b, n] = torch.where(keep, probs[b, n], 0.0)
            elif kind == 2:  # one-hot: mostly on a child's token (always accepted if tested)
                if kids and bool(torch.rand(1, generator=gen) < 0.7):
                    hot = int(cand[b, kids[-1]])
                else:
                    hot = int(torch.randint(0, vocab, (1,), generator=gen))
                probs[b, n] = 0.0
                probs[b, n, hot] = 1.0
    return (probs / probs.sum(dim=-1, keepdim=True)).float()


def spec_walk_sample(cand: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor,
                     coins: torch.Tensor, final_u: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampling rule exactly as worded in the brief: a per-row walk from the root."""
    batch, nodes, vocab = probs.shape
    index = torch.full((batch, nodes), -1, dtype=torch.int64)
    length = torch.zeros(batch, dtype=torch.int64)
    bonus = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        cur, path = 0, [0]
        while True:
            p = probs[b, cur].clone()
            accepted = None
            for c in [c for c in range(nodes) if int(parents[b, c]) == cur]:
                x = int(cand[b, c])
                if coins[b, c] * p.sum() < p[x]:
                    accepted = c
                    break
                p[x] = 0.0
            if accepted is None:
                break
            cur = accepted
            path.append(cur)
        if p.sum() <= 0:
            p = probs[b, cur].clone()
        cdf = torch.cumsum(p / p.sum(), dim=0)
        ok = ((cdf > final_u[b]) & (p > 0)).nonzero().flatten()
        nonzero = (p > 0).nonzero().flatten()
        bonus[b] = int(ok[0]) if ok.numel() else (int(nonzero[-1]) if nonzero.numel() else 0)
        index[b, : len(path)] = torch.tensor(path)
        length[b] = len(path) - 1
    return index, length, bonus


# ---------------------------------------------------------------- paged attention inputs


@dataclass
class AttentionCase:
    """One ``tree_attention`` problem on a paged pool; ``kwargs`` are the call's arguments."""

    kwargs: dict[str, Any]
    page_table: list[list[int]]  # pages of each request, in position order
    page_size: int
    prefix_lens: list[int]
    q_lens: list[int]


def make_attention_case(
    q_lens: list[int],
    prefix_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    tree: bool,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> AttentionCase:
    """Random q/k/v on a shuffled page pool; mask = prefix all True + ancestor closure (tree) or
    None (causal-at-the-end). Padding of kv_indices is -1 and padding of the mask is random, so
    reading either would show up as a mismatch."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(q_lens)
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    pages_per_req = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per_req) + 3  # a few pages nobody owns
    perm = torch.randperm(num_pages, generator=gen).tolist()
    lk_max = max(max(kv_lens), 1)
    kv_indices = torch.full((batch, lk_max), -1, dtype=torch.int64)
    page_table = []
    start = 0
    for b, n in enumerate(kv_lens):
        pages = perm[start : start + pages_per_req[b]]
        start += pages_per_req[b]
        page_table.append(pages)
        pos = torch.arange(n)
        kv_indices[b, :n] = torch.tensor(pages, dtype=torch.int64)[pos // page_size] * page_size \
            + pos % page_size
    slots = num_pages * page_size
    tokens = sum(q_lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    qo_indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int64)
    mask = None
    if tree:
        lq_max = max(max(q_lens), 1)
        mask = torch.rand(batch, lq_max, lk_max, generator=gen) < 0.5  # garbage in the padding
        for b in range(batch):
            n_q, pre = q_lens[b], prefix_lens[b]
            if n_q == 0:
                continue
            shape = ("random", "chain", "wide")[b % 3]
            mask[b, :n_q, :pre] = True
            mask[b, :n_q, pre : pre + n_q] = ancestor_closure(random_parents(n_q, gen, shape))
    kwargs: dict[str, Any] = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr, kv_indices=kv_indices,
        kv_lens=torch.tensor(kv_lens, dtype=torch.int64), mask=mask, sm_scale=head_dim**-0.5,
    )
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    return AttentionCase(kwargs, page_table, page_size, prefix_lens, q_lens)


# ---------------------------------------------------------------- statistics


def check_distribution(counts: torch.Tensor, probs: torch.Tensor, label: str) -> None:
    """Assert empirical ``counts`` (K,) fit ``probs`` (K,): chi-square (scipy) or a z tolerance.

    Cells with probability 0 must be empty. Fixed seeds make the outcome deterministic; the
    threshold (p > 1e-3, or |z| < 4.5) leaves room for a correct sampler at any seed.
    """
    counts = counts.double().cpu()
    probs = probs.double().cpu()
    n = float(counts.sum())
    assert n > 0, label
    zero = probs <= 0
    assert float(counts[zero].sum()) == 0, f"{label}: samples in zero-probability cells"
    cell = probs[~zero] / probs[~zero].sum()  # float32 rows sum to 1 only within round-off
    observed, expected = counts[~zero], cell * n
    try:
        from scipy.stats import chisquare
    except ImportError:
        z = (observed - expected) / torch.sqrt(expected * (1 - cell) + 1e-12)
        assert float(z.abs().max()) < 4.5, f"{label}: max |z| = {float(z.abs().max()):.2f}"
        return
    if observed.numel() < 2:
        return
    pvalue = float(chisquare(observed.numpy(), expected.numpy()).pvalue)
    assert pvalue > 1e-3, f"{label}: chi-square p = {pvalue:.2e}"

