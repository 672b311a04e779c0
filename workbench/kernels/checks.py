"""Argument checks shared by the Triton host wrappers and the torch references.

Two kinds of check live here:

* ``check_*_args``: shapes, dtypes and devices. They read only tensor metadata, never values, so
  they cost no device synchronisation and run on every call of either backend.
* ``check_*_values``: index ranges and tree invariants. They read values (``.tolist()``), so only
  the references run them; the Triton wrappers trust their callers (the engine builds these
  tensors itself) and guard their memory accesses with masks instead.

Every error is a ``ValueError`` whose message starts with the argument's name.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


# The helpers below build their message only when the check fails: the engine runs them on
# every step, right after forwards that left the caches cold, and formatting a shape, dtype or
# device costs more than the comparison.


def _need_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _need_dtype(name: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        got = str(x.dtype).removeprefix("torch.")
        raise ValueError(f"{name} must have dtype {allowed}, got {got}")


def _need_shape(name: str, x: torch.Tensor, shape: tuple[int, ...], symbols: str) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {symbols} = {shape}, got {tuple(x.shape)}")


def _need_device(name: str, x: torch.Tensor, device: torch.device, ref: str) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {ref} is on {device}")


class AttentionDims(NamedTuple):
    """Sizes of one ``tree_attention`` call."""

    batch: int  # B
    tokens: int  # T
    heads: int  # H
    kv_heads: int  # Hkv
    head_dim: int  # hd
    slots: int  # S
    lk_max: int  # Lk_max
    lq_max: int | None  # Lq_max (None when mask is None)


def check_tree_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    mask: torch.Tensor | None,
    sm_scale: float,
) -> AttentionDims:
    """Check shapes/dtypes/devices of a ``tree_attention`` call (see ``reference.tree_attention``).

    Returns the sizes. Raises ``ValueError`` naming the first offending argument.
    """
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("qo_indptr", qo_indptr), ("kv_indices", kv_indices), ("kv_lens", kv_lens)):
        _need_tensor(name, x)
    _need(q.dim() == 3, f"q must be 3-D (T, H, hd), got shape {tuple(q.shape)}")
    _need_dtype("q", q, FLOAT_DTYPES)
    tokens, heads, head_dim = q.shape
    _need(k_cache.dim() == 3, f"k_cache must be 3-D (S, Hkv, hd), got shape {tuple(k_cache.shape)}")
    slots, kv_heads, k_dim = k_cache.shape
    _need(k_dim == head_dim, f"k_cache head dim {k_dim} does not match q head dim {head_dim}")
    _need(kv_heads >= 1 and heads % kv_heads == 0,
          f"k_cache has {kv_heads} kv heads, which must divide q's {heads} heads (GQA)")
    _need_shape("v_cache", v_cache, tuple(k_cache.shape), "(S, Hkv, hd)")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _need(x.dtype == q.dtype, f"{name} dtype {x.dtype} differs from q dtype {q.dtype}")
    _need(qo_indptr.dim() == 1 and qo_indptr.shape[0] >= 2,
          f"qo_indptr must be 1-D (B+1,) with B >= 1, got shape {tuple(qo_indptr.shape)}")
    _need_dtype("qo_indptr", qo_indptr, (torch.int64,))
    batch = qo_indptr.shape[0] - 1
    _need(kv_indices.dim() == 2 and kv_indices.shape[0] == batch,
          f"kv_indices must have shape (B, Lk_max) with B = {batch}, "
          f"got {tuple(kv_indices.shape)}")
    _need_dtype("kv_indices", kv_indices, (torch.int64,))
    lk_max = kv_indices.shape[1]
    _need_shape("kv_lens", kv_lens, (batch,), "(B,)")
    _need_dtype("kv_lens", kv_lens, (torch.int64,))
    lq_max: int | None = None
    if mask is not None:
        _need_tensor("mask", mask)
        _need(mask.dim() == 3 and mask.shape[0] == batch and mask.shape[2] == lk_max,
              f"mask must have shape (B, Lq_max, Lk_max) = ({batch}, Lq_max, {lk_max}), "
              f"got {tuple(mask.shape)}")
        _need_dtype("mask", mask, (torch.bool,))
        lq_max = mask.shape[1]
    _need(isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale),
          f"sm_scale must be a finite Python float, got {sm_scale!r}")
    tensors = [("k_cache", k_cache), ("v_cache", v_cache), ("qo_indptr", qo_indptr),
               ("kv_indices", kv_indices), ("kv_lens", kv_lens)]
    if mask is not None:
        tensors.append(("mask", mask))
    for name, x in tensors:
        _need_device(name, x, q.device, "q")
    return AttentionDims(batch, tokens, heads, kv_heads, head_dim, slots, lk_max, lq_max)


def check_tree_attention_values(
    dims: AttentionDims,
    qo_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
) -> tuple[list[int], list[int]]:
    """Check index ranges (reads values: syncs a GPU). Returns (qo_indptr, kv_lens) as lists."""
    indptr = qo_indptr.tolist()
    lens = kv_lens.tolist()
    _need(indptr[0] == 0, f"qo_indptr[0] must be 0, got {indptr[0]}")
    _need(indptr[-1] == dims.tokens,
          f"qo_indptr[-1] must equal T = q.shape[0] = {dims.tokens}, got {indptr[-1]}")
    for b in range(dims.batch):
        q_len = indptr[b + 1] - indptr[b]
        _need(q_len >= 0, f"qo_indptr must be non-decreasing, but qo_indptr[{b + 1}] < [{b}]")
        _need(q_len <= lens[b] <= dims.lk_max,
              f"kv_lens[{b}] = {lens[b]} must lie in [q_len, Lk_max] = [{q_len}, {dims.lk_max}]"
              " (the kv entries include the new tokens)")
        if dims.lq_max is not None:
            _need(q_len <= dims.lq_max,
                  f"mask has Lq_max = {dims.lq_max} rows but request {b} has {q_len} queries")
        if lens[b] > 0:
            row = kv_indices[b, : lens[b]]
            lo, hi = int(row.min()), int(row.max())
            _need(0 <= lo and hi < dims.slots,
                  f"kv_indices[{b}, :{lens[b]}] must be slot ids in [0, S = {dims.slots}), "
                  f"got range [{lo}, {hi}]")
    return indptr, lens


def check_tree_args(
    candidates: torch.Tensor,
    parents: torch.Tensor,
) -> tuple[int, int]:
    """Check the (B, N) int64 tree tensors shared by the acceptance kernels. Returns (B, N)."""
    _need_tensor("candidates", candidates)
    _need_tensor("parents", parents)
    if not (candidates.dim() == 2 and candidates.shape[1] >= 1):
        raise ValueError("candidates must be 2-D (B, N) with N >= 1, got shape "
                         f"{tuple(candidates.shape)}")
    _need_dtype("candidates", candidates, (torch.int64,))
    batch, nodes = candidates.shape
    _need_shape("parents", parents, (batch, nodes), "(B, N)")
    _need_dtype("parents", parents, (torch.int64,))
    _need_device("parents", parents, candidates.device, "candidates")
    return batch, nodes


def check_tree_values(parents: torch.Tensor) -> None:
    """Check parents[:, 0] = -1 and 0 <= parents[b, i] < i for i >= 1 (reads values)."""
    nodes = parents.shape[1]
    _need(bool((parents[:, 0] == -1).all()), "parents[:, 0] must be -1 (node 0 is the root)")
    if nodes > 1:
        idx = torch.arange(1, nodes, device=parents.device)
        rest = parents[:, 1:]
        bad = (rest < 0) | (rest >= idx)
        if bool(bad.any()):
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"parents[{b}, {i + 1}] = {int(rest[b, i])} must lie in [0, {i + 1}) "
                "(every node's parent has a smaller index)"
            )


def check_tree_rows(parents: list[list[int]]) -> None:
    """:func:`check_tree_values` over parents already read to the host (``tolist()``): the
    same rule and message, no tensor ops."""
    _need(all(not row or row[0] == -1 for row in parents),
          "parents[:, 0] must be -1 (node 0 is the root)")
    for b, row in enumerate(parents):
        for i in range(1, len(row)):
            if not 0 <= row[i] < i:
                raise ValueError(f"parents[{b}, {i}] = {row[i]} must lie in [0, {i}) "
                                 "(every node's parent has a smaller index)")


def check_greedy_accept_args(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor
) -> tuple[int, int]:
    """Check a ``greedy_accept`` call. Returns (B, N)."""
    batch, nodes = check_tree_args(candidates, parents)
    _need_tensor("target_predict", target_predict)
    _need_shape("target_predict", target_predict, (batch, nodes), "(B, N)")
    _need_dtype("target_predict", target_predict, (torch.int64,))
    _need_device("target_predict", target_predict, candidates.device, "candidates")
    return batch, nodes


def check_tree_sample_args(
    candidates: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_u: torch.Tensor,
) -> tuple[int, int, int]:
    """Check a ``tree_speculative_sample`` call. Returns (B, N, V)."""
    batch, nodes = check_tree_args(candidates, parents)
    for name, x in (("target_probs", target_probs), ("coins", coins), ("final_u", final_u)):
        _need_tensor(name, x)
    _need(target_probs.dim() == 3 and tuple(target_probs.shape[:2]) == (batch, nodes)
          and target_probs.shape[2] >= 1,
          f"target_probs must have shape (B, N, V) = ({batch}, {nodes}, V), "
          f"got {tuple(target_probs.shape)}")
    _need_dtype("target_probs", target_probs, (torch.float32,))
    _need_shape("coins", coins, (batch, nodes), "(B, N)")
    _need_dtype("coins", coins, (torch.float32,))
    _need_shape("final_u", final_u, (batch,), "(B,)")
    _need_dtype("final_u", final_u, (torch.float32,))
    for name, x in (("target_probs", target_probs), ("coins", coins), ("final_u", final_u)):
        _need_device(name, x, candidates.device, "candidates")
    return batch, nodes, target_probs.shape[2]


def check_tree_sample_values(candidates: torch.Tensor, parents: torch.Tensor, vocab: int) -> None:
    """Tree invariants, and draft tokens of non-root nodes in [0, V) (reads values)."""
    check_tree_values(parents)
    if candidates.shape[1] > 1:
        tokens = candidates[:, 1:]
        lo, hi = int(tokens.min()), int(tokens.max())
        _need(0 <= lo and hi < vocab,
              f"candidates[:, 1:] must be token ids in [0, V = {vocab}), got range [{lo}, {hi}]")


def check_compact_kv_args(
    k_pool: torch.Tensor, v_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> tuple[int, int, int]:
    """Check a ``compact_kv`` call. Returns (L, S, M) with M = number of copies."""
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool), ("src_slots", src_slots),
                    ("dst_slots", dst_slots)):
        _need_tensor(name, x)
    if k_pool.dim() != 4:
        raise ValueError(f"k_pool must be 4-D (L, S, Hkv, hd), got shape {tuple(k_pool.shape)}")
    _need_shape("v_pool", v_pool, tuple(k_pool.shape), "(L, S, Hkv, hd)")
    if v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool dtype {v_pool.dtype} differs from k_pool dtype {k_pool.dtype}")
    if src_slots.dim() != 1:
        raise ValueError(f"src_slots must be 1-D (M,), got shape {tuple(src_slots.shape)}")
    _need_dtype("src_slots", src_slots, (torch.int64,))
    _need_shape("dst_slots", dst_slots, tuple(src_slots.shape), "(M,)")
    _need_dtype("dst_slots", dst_slots, (torch.int64,))
    for name, x in (("v_pool", v_pool), ("src_slots", src_slots), ("dst_slots", dst_slots)):
        _need_device(name, x, k_pool.device, "k_pool")
    return k_pool.shape[0], k_pool.shape[1], src_slots.shape[0]


def check_compact_kv_values(src_slots: torch.Tensor, dst_slots: torch.Tensor, slots: int,
                            host: tuple[list[int], list[int]] | None = None) -> None:
    """Slots in [0, S) and destinations distinct (reads values; ``host``: the same values as
    host lists already, not read back)."""
    if src_slots.numel() == 0:
        return
    # one read of each (M is a tree's accepted nodes: a handful), checked on host ints
    src, dst = host if host is not None else (src_slots.tolist(), dst_slots.tolist())
    for name, xs in (("src_slots", src), ("dst_slots", dst)):
        lo, hi = min(xs), max(xs)
        if not (0 <= lo and hi < slots):
            raise ValueError(f"{name} must be slot ids in [0, S = {slots}), got range [{lo}, {hi}]")
    _need(len(set(dst)) == len(dst),
          "dst_slots must be distinct (two copies into one slot have no defined winner)")
