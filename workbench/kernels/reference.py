"""Torch references: the specification of every kernel, and its CPU fallback.

Each function here defines what its Triton twin must compute (the tests compare them at awkward
sizes) and is what ``workbench.kernels`` runs on CPU tensors. They favour clarity, then speed:
loops run over requests or tree nodes, never over tokens of the vocabulary.

Symbols: B batch, N tree nodes, H query heads, Hkv kv heads, hd head dim, V vocab, S pool slots,
T ragged query tokens, L layers, M copies.

The two acceptance rules follow EAGLE (Li et al., 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty") and SpecInfer's multi-candidate recursive rejection sampling.
"""

from __future__ import annotations

from array import array

import torch

from workbench.kernels.checks import (
    check_compact_kv_args,
    check_compact_kv_values,
    check_greedy_accept_args,
    check_tree_attention_args,
    check_tree_attention_values,
    check_tree_rows,
    check_tree_sample_args,
    check_tree_sample_values,
    check_tree_values,
)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    mask: torch.Tensor | None,
    sm_scale: float,
    *,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Attention of ragged queries over a paged KV pool, with a per-request mask.

    Args:
        q: queries. Shape: (T, H, hd), float16/bfloat16/float32. Request b owns rows
            ``qo_indptr[b]:qo_indptr[b+1]``.
        k_cache: keys of one layer of the paged pool. Shape: (S, Hkv, hd), dtype of q. A slot is
            ``page * page_size + offset``; only slot ids are seen here.
        v_cache: values, like k_cache. Shape: (S, Hkv, hd).
        qo_indptr: query offsets. Shape: (B+1,), int64.
        kv_indices: slot ids of each request's kv entries, in position order. Shape:
            (B, Lk_max), int64; row b is valid for its first ``kv_lens[b]`` entries, which include
            the new tokens themselves (already written to the pool).
        kv_lens: kv entries per request. Shape: (B,), int64; ``q_len_b <= kv_lens[b] <= Lk_max``.
        mask: ``True`` = may attend. Shape: (B, Lq_max, Lk_max), bool; only
            ``mask[b, :q_len_b, :kv_lens[b]]`` is read. ``None`` means causal-at-the-end: query i
            of request b sees kv entries ``j <= kv_lens[b] - q_len_b + i``. A tree verify passes
            the prefix all True plus the ancestor closure (including self) over the tree block.
        sm_scale: softmax scale, usually ``hd ** -0.5``.
        max_q_len: unused here (the Triton wrapper's launch hint); accepted for one signature.

    Returns:
        o: Shape: (T, H, hd), dtype of q. Query head h reads kv head ``h // (H // Hkv)``. Scores
        and softmax in fp32. A query that may attend to nothing gets zeros.
    """
    dims = check_tree_attention_args(q, k_cache, v_cache, qo_indptr, kv_indices, kv_lens, mask,
                                     sm_scale)
    indptr, lens = check_tree_attention_values(dims, qo_indptr, kv_indices, kv_lens)
    group = dims.heads // dims.kv_heads
    o = torch.zeros_like(q)
    for b in range(dims.batch):
        q0, q1, n_kv = indptr[b], indptr[b + 1], lens[b]
        n_q = q1 - q0
        if n_q == 0:
            continue
        slots = kv_indices[b, :n_kv]
        # Gather this request's kv and expand kv heads to query heads: (n_kv, H, hd).
        k = k_cache[slots].float().repeat_interleave(group, dim=1)
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * sm_scale  # (H, n_q, n_kv)
        if mask is None:
            pos = torch.arange(n_kv, device=q.device)
            last = n_kv - n_q + torch.arange(n_q, device=q.device)
            allowed = pos[None, :] <= last[:, None]  # (n_q, n_kv)
        else:
            allowed = mask[b, :n_q, :n_kv]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows → 0
        o[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return o


def greedy_accept(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy (argmax) verification of a draft tree.

    Walk from the root: among the children of the current node, in increasing index order,
    accept the first child c with ``candidates[b, c] == target_predict[b, cur]``; repeat from c.

    Args:
        candidates: draft token of each node; node 0 is the root (the last verified token).
            Shape: (B, N), int64.
        parents: parent index of each node; ``parents[:, 0] = -1``, ``parents[b, i] < i``.
            Shape: (B, N), int64.
        target_predict: target argmax at each node. Shape: (B, N), int64.

    Returns:
        accept_index: node indices of the accepted path, starting with 0, padded with -1.
            Shape: (B, N), int64.
        accept_len: accepted non-root nodes. Shape: (B,), int64.
        bonus: ``target_predict`` at the last accepted node. Shape: (B,), int64.
    """
    batch, nodes = check_greedy_accept_args(candidates, parents, target_predict)
    check_tree_values(parents)
    device = candidates.device
    rows = torch.arange(batch, device=device)
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    accept_len = torch.zeros(batch, dtype=torch.int64, device=device)
    accept_index = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    accept_index[:, 0] = 0
    # One pass over nodes in index order visits each node's children in increasing order, and a
    # node is tested only while its parent is the current node: every child of an accepted node
    # c has an index > c, and c's later siblings no longer match ``cur``. This is the walk above.
    for c in range(1, nodes):
        hit = (parents[:, c] == cur) & (candidates[:, c] == target_predict[rows, cur])
        accept_len += hit.long()
        accept_index[rows[hit], accept_len[hit]] = c
        cur = torch.where(hit, c, cur)
    return accept_index, accept_len, target_predict[rows, cur]


def greedy_accept_walk(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`greedy_accept` as a plain Python walk over the rows (CPU dispatch: at B·N of a
    few dozen, a hundred tiny tensor ops cost more than the walk itself). Same contract and
    results (tests/kernels checks them equal)."""
    return greedy_accept_host(candidates, parents, target_predict)[0]


def greedy_accept_host(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor,
    tree_lists: tuple[list[list[int]], list[list[int]]] | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor],
           tuple[list[list[int]], list[int], list[int], list[list[int]]]]:
    """:func:`greedy_accept_walk`'s tensors, and the same results as the host lists the walk
    made (accept_index rows, accept_len, bonus, and the candidates it read), for a caller that
    reads them on the host next (the engine's commit) without reading the tensors back.
    ``tree_lists``: ``candidates`` and ``parents`` as host lists already (``DraftTree.host``),
    the same values (not read back from the tensors then)."""
    batch, nodes = check_greedy_accept_args(candidates, parents, target_predict)
    cand, par = tree_lists if tree_lists is not None else (candidates.tolist(),
                                                           parents.tolist())
    pred = target_predict.tolist()
    check_tree_rows(par)
    accept_index = [[-1] * nodes for _ in range(batch)]
    accept_len, bonus = [0] * batch, [0] * batch
    for b in range(batch):
        cb, pb, tb, idx = cand[b], par[b], pred[b], accept_index[b]
        idx[0] = cur = 0
        n = 0
        for c in range(1, nodes):  # children of cur come after it, in index order
            if pb[c] == cur and cb[c] == tb[cur]:
                n += 1
                idx[n] = cur = c
        accept_len[b], bonus[b] = n, tb[cur]
    # one buffer (one host→device copy off the CPU): [accept_index | accept_len | bonus] per
    # row, returned as views
    flat = array("q")
    for idx, n, t in zip(accept_index, accept_len, bonus, strict=True):
        flat.extend(idx)
        flat.append(n)
        flat.append(t)
    out = torch.frombuffer(flat, dtype=torch.int64).view(batch, nodes + 2) if flat \
        else torch.empty(batch, nodes + 2, dtype=torch.int64, device="cpu")
    if out.device != candidates.device:
        out = out.to(candidates.device)
    return ((out[:, :nodes], out[:, nodes], out[:, nodes + 1]),
            (accept_index, accept_len, bonus, cand))


def _inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Smallest t with ``cumsum(p / p.sum())[t] > u`` and ``p[t] > 0``, per row.

    p: (B, V) non-negative float32; u: (B,) in [0, 1). Round-off can leave the total below u;
    then the last token with nonzero probability is returned (0 for an all-zero row).
    """
    vocab = p.shape[1]
    ids = torch.arange(vocab, device=p.device)
    cdf = torch.cumsum(p / p.sum(dim=1, keepdim=True), dim=1)
    first = torch.where((cdf > u[:, None]) & (p > 0), ids, vocab).min(dim=1).values
    last_nonzero = torch.where(p > 0, ids, -1).max(dim=1).values.clamp_min(0)
    return torch.where(first < vocab, first, last_nonzero)


def tree_speculative_sample(
    candidates: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless recursive rejection sampling of a draft tree with one-hot (top-k) drafts.

    Step 1: at the current node take the residual ``p = target_probs[b, cur]`` (a copy).
    Step 2: for each child c of cur in increasing index order, with token x: accept iff
    ``coins[b, c] * p.sum() < p[x]``. Accepted: cur = c, go to step 1 (fresh residual).
    Rejected: ``p[x] = 0`` and test the next child.
    Step 3: no child accepted (or none exist): the bonus token is the inverse-CDF sample of
    ``p / p.sum()`` at ``final_u`` (smallest t with ``cumsum[t] > final_u``; if round-off leaves
    none, the last token with nonzero probability). If the residual has no mass at all, which
    only round-off can cause, the unmodified ``target_probs[b, cur]`` is sampled instead.

    The emitted tokens are distributed exactly as sampling the target token by token.

    Args:
        candidates: draft token of each node (node 0, the root, is not tested).
            Shape: (B, N), int64; ``candidates[:, 1:]`` in [0, V).
        parents: ``parents[:, 0] = -1``, ``parents[b, i] < i``. Shape: (B, N), int64.
        target_probs: target distribution at each node, already temperature/top-k/top-p
            processed; rows sum to 1. Shape: (B, N, V), float32.
        coins: uniform [0, 1); ``coins[b, c]`` is used when child c is tested.
            Shape: (B, N), float32.
        final_u: uniform [0, 1) for the bonus token. Shape: (B,), float32.

    Returns:
        accept_index: accepted path from node 0, padded with -1. Shape: (B, N), int64.
        accept_len: accepted non-root nodes. Shape: (B,), int64.
        bonus: token sampled at the last accepted node. Shape: (B,), int64.
    """
    batch, nodes, vocab = check_tree_sample_args(candidates, parents, target_probs, coins, final_u)
    check_tree_sample_values(candidates, parents, vocab)
    device = candidates.device
    rows = torch.arange(batch, device=device)
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    accept_len = torch.zeros(batch, dtype=torch.int64, device=device)
    accept_index = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    accept_index[:, 0] = 0
    p = target_probs[:, 0].clone()  # (B, V) residual at each row's current node
    # Same single pass in index order as greedy_accept (see there why it equals the walk).
    for c in range(1, nodes):
        x = candidates[:, c]
        is_child = parents[:, c] == cur
        p_x = p[rows, x]
        accept = is_child & (coins[:, c] * p.sum(dim=1) < p_x)
        reject = is_child & ~accept
        p[rows[reject], x[reject]] = 0.0
        p[accept] = target_probs[accept, c]
        accept_len += accept.long()
        accept_index[rows[accept], accept_len[accept]] = c
        cur = torch.where(accept, c, cur)
    empty = p.sum(dim=1) <= 0
    p = torch.where(empty[:, None], target_probs[rows, cur], p)
    return accept_index, accept_len, _inverse_cdf(p, final_u)


def compact_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
    host: tuple[list[int], list[int]] | None = None
) -> None:
    """Move KV entries between slots, all layers, in place: ``pool[:, dst[i]] = pool[:, src[i]]``.

    All sources are read before any destination is written (gather, then scatter), so the sets
    may overlap — as when an accepted path is packed to the front of its tree block.

    Args:
        k_pool: keys of all layers. Shape: (L, S, Hkv, hd).
        v_pool: values. Shape: (L, S, Hkv, hd), dtype of k_pool.
        src_slots: slots to read. Shape: (M,), int64, in [0, S).
        dst_slots: slots to write. Shape: (M,), int64, in [0, S), distinct.
        host: ``src_slots`` and ``dst_slots`` as host lists, when the caller has them (the
            values are checked on them, not read back).
    """
    _, slots, _ = check_compact_kv_args(k_pool, v_pool, src_slots, dst_slots)
    check_compact_kv_values(src_slots, dst_slots, slots, host)
    both = _halves(k_pool, v_pool)
    for pool in (k_pool, v_pool) if both is None else (both,):
        # gather (a copy), then scatter; index_select/index_copy_ rather than pool[:, dst] =
        # pool[:, src]: the same copies at 6 vs 150 µs for a few rows of an 18-layer pool
        slot_dim = pool.dim() - 3  # (L, S, Hkv, hd), or (2, L, S, Hkv, hd) for both
        pool.index_copy_(slot_dim, dst_slots, pool.index_select(slot_dim, src_slots))


def _halves(k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor | None:
    """(2, L, S, Hkv, hd): the one tensor whose [0] and [1] are ``k_pool`` and ``v_pool`` (a
    pool allocating them together: KVPool), so one gather and one scatter move both; else
    None."""
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()
            and v_pool.untyped_storage().data_ptr() == k_pool.untyped_storage().data_ptr()
            and v_pool.storage_offset() == k_pool.storage_offset() + k_pool.numel()):
        return None
    return k_pool.as_strided((2, *k_pool.shape), (k_pool.numel(), *k_pool.stride()),
                             k_pool.storage_offset())
