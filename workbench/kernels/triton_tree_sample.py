# mypy: allow-untyped-defs
# (@triton.jit parameters stay unannotated: Triton gives annotations a meaning of its own.)
"""Tree speculative sampling (recursive rejection, one-hot drafts): Triton kernel and wrapper.

Specification: ``workbench.kernels.reference.tree_speculative_sample``.

One program per request. The residual distribution is never materialised: at the current node
it is ``target_probs[b, cur]`` with the tokens of rejected children zeroed, so the program keeps
the (at most N) rejected tokens in registers and the residual mass as a scalar
(``mass - p[x]`` after each rejection). Acceptance is one pass over node indices, as in
``greedy_accept``. The bonus token takes two passes over the vocabulary at the final node: the
residual's mass, then the inverse CDF.

Memory traffic per program: read V floats at the root and at each accepted node (its mass),
2*V floats at the final node, and 3*N + 1 scalars; write N+2 int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels.checks import check_tree_sample_args


@triton.jit
def _row_sum(row_ptr, stride_v, vocab, BLOCK_V: tl.constexpr):
    """Sum of a (V,) fp32 row."""
    acc = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        acc += tl.load(row_ptr + offs * stride_v, mask=offs < vocab, other=0.0)
    return tl.sum(acc, 0)


@triton.jit
def _residual_block(row_ptr, stride_v, v0, vocab, rejected, BLOCK_V: tl.constexpr):
    """Tokens v0 .. v0+BLOCK_V of a node's residual: its row with the ``rejected`` tokens zeroed.

    rejected: (BLOCK_N,) int64 token ids, -1 for none. Returns (offs int32, p fp32) blocks.
    """
    offs = v0 + tl.arange(0, BLOCK_V)
    p = tl.load(row_ptr + offs * stride_v, mask=offs < vocab, other=0.0)
    in_block = tl.sum(((rejected >= v0) & (rejected < v0 + BLOCK_V)).to(tl.int32), 0)
    if in_block > 0:  # rare: compare the block against the rejected tokens only when needed
        hit = tl.sum((offs[:, None] == rejected[None, :]).to(tl.int32), 1) > 0
        p = tl.where(hit, 0.0, p)
    return offs, p


@triton.jit
def _tree_sample_kernel(
    cand_ptr, parents_ptr, probs_ptr, coins_ptr, final_u_ptr,
    accept_index_ptr, accept_len_ptr, bonus_ptr,
    n_nodes, vocab,
    stride_cb, stride_pb, stride_sb, stride_sn, stride_sv, stride_kb, stride_ab,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    path = tl.where(offs_n == 0, 0, -1).to(tl.int64)
    cur = b * 0  # int64 scalar: current node
    depth = b * 0
    rows = probs_ptr + b * stride_sb  # this request's (N, V) block
    # Step 1: the residual at the root; `mass` tracks its sum as children are rejected.
    mass = _row_sum(rows, stride_sv, vocab, BLOCK_V)
    rejected = tl.full([BLOCK_N], -1, tl.int64)  # tokens of cur's rejected children
    # Step 2: children in increasing index order; an accepted child restarts at step 1.
    for c in range(1, n_nodes):
        parent = tl.load(parents_ptr + b * stride_pb + c)
        token = tl.load(cand_ptr + b * stride_cb + c)
        coin = tl.load(coins_ptr + b * stride_kb + c)
        token_ok = (token >= 0) & (token < vocab)
        p_tok = tl.load(rows + cur * stride_sn + token * stride_sv, mask=token_ok, other=0.0)
        seen = tl.sum((rejected == token).to(tl.int32), 0) > 0  # a sibling already zeroed it
        p_tok = tl.where(seen, 0.0, p_tok)
        is_child = parent == cur
        accept = is_child & (coin * mass < p_tok)
        reject = is_child & (coin * mass >= p_tok)
        rejected = tl.where(reject & (offs_n == c), token, rejected)
        mass = tl.where(reject, mass - p_tok, mass)
        cur = tl.where(accept, c, cur)
        depth = depth + accept.to(tl.int64)
        path = tl.where(accept & (offs_n == depth), c, path)
        rejected = tl.where(accept, -1, rejected)
        if accept:
            mass = _row_sum(rows + cur * stride_sn, stride_sv, vocab, BLOCK_V)

    # Step 3: bonus token from the residual at cur. Pass 1: its mass, recomputed exactly.
    node = rows + cur * stride_sn
    acc = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        _, p = _residual_block(node, stride_sv, v0, vocab, rejected, BLOCK_V)
        acc += p
    total = tl.sum(acc, 0)
    if total <= 0.0:  # only round-off gets here: sample the unmodified row instead
        rejected = tl.full([BLOCK_N], -1, tl.int64)
        total = _row_sum(node, stride_sv, vocab, BLOCK_V)
    # Pass 2: smallest t with cdf[t] > u and p[t] > 0; else the last nonzero token.
    u = tl.load(final_u_ptr + b)
    running = total * 0.0
    first = vocab + 0 * tl.program_id(0)
    last_nonzero = -1 + 0 * tl.program_id(0)
    for v0 in range(0, vocab, BLOCK_V):
        offs, p = _residual_block(node, stride_sv, v0, vocab, rejected, BLOCK_V)
        cdf = running + tl.cumsum(p / total, 0)
        first = tl.minimum(first, tl.min(tl.where((cdf > u) & (p > 0.0), offs, vocab), 0))
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(p > 0.0, offs, -1), 0))
        running = tl.max(cdf, 0)
    bonus_token = tl.where(first < vocab, first, tl.maximum(last_nonzero, 0))

    tl.store(accept_index_ptr + b * stride_ab + offs_n, path, mask=offs_n < n_nodes)
    tl.store(accept_len_ptr + b, depth)
    tl.store(bonus_ptr + b, bonus_token.to(tl.int64))


def tree_speculative_sample_triton(
    candidates: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton ``tree_speculative_sample``; arguments/results as the reference's.

    Shapes, dtypes and devices are checked; tree invariants and token ranges are not (no value
    reads; an out-of-range draft token is treated as probability 0).

    Args:
        candidates: Shape: (B, N), int64.
        parents: Shape: (B, N), int64.
        target_probs: Shape: (B, N, V), float32 (any strides).
        coins: Shape: (B, N), float32.
        final_u: Shape: (B,), float32.

    Returns:
        accept_index (B, N) int64, accept_len (B,) int64, bonus (B,) int64.
    """
    batch, nodes, vocab = check_tree_sample_args(candidates, parents, target_probs, coins, final_u)
    candidates, parents, coins = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (candidates, parents, coins)
    )
    final_u = final_u.contiguous()
    device = candidates.device
    accept_index = torch.empty((batch, nodes), dtype=torch.int64, device=device)
    accept_len = torch.empty(batch, dtype=torch.int64, device=device)
    bonus = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return accept_index, accept_len, bonus
    # Blocks of >= 16 lanes (no degenerate 1-wide layouts). The rejected-token compare is a
    # (BLOCK_V, BLOCK_N) tile: keep it at <= 16k elements.
    block_n = max(16, triton.next_power_of_2(nodes))
    block_v = max(16, min(triton.next_power_of_2(vocab), 16384 // block_n, 2048))
    _tree_sample_kernel[(batch,)](
        candidates, parents, target_probs, coins, final_u,
        accept_index, accept_len, bonus,
        nodes, vocab,
        candidates.stride(0), parents.stride(0),
        target_probs.stride(0), target_probs.stride(1), target_probs.stride(2),
        coins.stride(0), accept_index.stride(0),
        BLOCK_N=block_n, BLOCK_V=block_v,
    )
    return accept_index, accept_len, bonus
