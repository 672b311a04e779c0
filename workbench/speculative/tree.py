"""EAGLE-2 dynamic draft tree as pure tensor functions (Li et al., 2024, "EAGLE-2").

1. Depth 1: the draft's top-K tokens after the root, scored by log-prob.
2. Each later step: every frontier node proposes its top-K children; a child's score is its
   parent's score plus its own log-prob; the best K of the K² children become the new frontier.
3. After S steps, rerank every candidate globally and keep the best N−1, then restore creation
   order so parents precede children (a child never outscores its parent, and a stable sort
   breaks ties by creation order, so every kept node's parent is kept).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

from workbench.core import DraftTree


def expand(frontier_scores: torch.Tensor, logp: torch.Tensor,
           k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """frontier_scores (B, F), logp (B, F, Vd) → child draft ids (B, F·K), scores (B, F·K),
    child log-probs (B, F·K). Children of frontier f occupy columns [f·K, (f+1)·K)."""
    # clamped after the top-k (the same picks: at most one log-prob of a row can round above 0)
    lp, ids = torch.topk(logp, k, dim=-1)  # (B, F, K)
    lp = lp.clamp(max=0.0)
    scores = frontier_scores.unsqueeze(-1) + lp
    return ids.flatten(1), scores.flatten(1), lp.flatten(1)


def select_frontier(child_scores: torch.Tensor, k: int) -> torch.Tensor:
    """child_scores (B, C) → indices (B, k) of the best k (stable: ties by creation order)."""
    order = torch.sort(child_scores, dim=-1, descending=True, stable=True).indices
    return order[:, :k]


def build_tree(root_tokens: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
               cand_scores: torch.Tensor, cand_logp: torch.Tensor, num_draft_tokens: int,
               prefix_lens: torch.Tensor) -> DraftTree:
    """Global rerank to N−1 candidates plus the root.

    root_tokens (B,); cand_* (B, C) in creation order; cand_parents holds the candidate index
    of each node's parent (-1 for children of the root); prefix_lens (B,) = position of the
    root. Returns a DraftTree with N = num_draft_tokens nodes.
    """
    b, c = cand_tokens.shape
    n = num_draft_tokens
    keep = min(n - 1, c)
    dev = cand_tokens.device
    k = _consts(b, c, keep, dev)
    order = torch.sort(cand_scores, dim=-1, descending=True, stable=True).indices[:, :keep]
    chosen = torch.sort(order, dim=-1).values  # creation order ⇒ parents first
    # Map candidate index + 1 → tree node index: column 0 stands for the root (a parent of
    # -1, node 0), unselected candidates stay -1.
    where = k.where0.clone().scatter_(1, chosen + 1, k.nodes)
    par_node = torch.gather(where, 1, torch.gather(cand_parents, 1, chosen) + 1)
    if bool((par_node < 0).any()):
        raise AssertionError("draft tree: a selected node's parent was not selected")
    tokens = torch.cat([root_tokens.view(b, 1), torch.gather(cand_tokens, 1, chosen)], 1)
    parents = torch.cat([k.minus1, par_node], 1)
    scores = torch.cat([k.zeros, torch.gather(cand_scores, 1, chosen).float()], 1)
    probs = torch.cat([k.ones, torch.gather(cand_logp, 1, chosen).float().exp()], 1)
    return finish_tree(tokens, parents, scores, probs, prefix_lens)


class _Consts:
    """Per-shape constant tensors build_tree and finish_tree reuse (never written to)."""

    def __init__(self, b: int, c: int, keep: int, dev: torch.device) -> None:
        self.where0 = torch.full((b, c + 1), -1, dtype=torch.int64, device=dev)
        self.where0[:, 0] = 0
        self.nodes = torch.arange(1, keep + 1, device=dev).expand(b, keep)
        self.minus1 = torch.full((b, 1), -1, dtype=torch.int64, device=dev)
        self.zeros = torch.zeros(b, 1, device=dev)
        self.ones = torch.ones(b, 1, device=dev)


T = TypeVar("T")
CACHE_LIMIT = 64  # shapes per cache: a few in practice; never grows without bound


def per_shape(store: dict[Hashable, T], key: Hashable, make: Callable[[], T]) -> T:
    """``store[key]``, built by ``make()`` the first time; a store past ``CACHE_LIMIT``
    entries starts over (the per-shape constants of the draft loop and the tree build)."""
    v = store.get(key)
    if v is None:
        if len(store) > CACHE_LIMIT:
            store.clear()
        v = store[key] = make()
    return v


_CONSTS: dict[Hashable, _Consts] = {}


def _consts(b: int, c: int, keep: int, dev: torch.device) -> _Consts:
    # inference tensors (built under inference_mode) are kept apart from normal ones
    key = (b, c, keep, str(dev), torch.is_inference_mode_enabled())
    return per_shape(_CONSTS, key, lambda: _Consts(b, c, keep, dev))


def finish_tree(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
                probs: torch.Tensor, prefix_lens: torch.Tensor) -> DraftTree:
    """Depth, positions and ancestor mask from parent pointers (B, N), on the tokens' device.

    Pointer jumping, no host round trip: ``anc`` starts as each node and its parent (the root
    its own parent: a fixed point); each round ORs in the ancestor rows of the node ``jump``
    points at and squares ``jump``, doubling the path length covered (1, 3, 7, 15, ...), so
    ceil(log2 N) − 1 rounds cover any tree of N nodes. Depth = ancestors-or-self − 1. As fast
    as the former per-row host loop at N=16 on the CPU (29 µs), and no device→host copy on a
    GPU."""
    b, n = tokens.shape
    dev = tokens.device
    jump = parents.clamp(min=0)
    anc = _eye(n, dev).expand(b, n, n).clone().scatter_(2, jump.unsqueeze(-1), True)
    reach = 1  # path length anc covers
    while reach < n - 1:
        jump = torch.gather(jump, 1, jump)
        anc |= torch.gather(anc, 1, jump.unsqueeze(-1).expand(b, n, n))
        reach = 2 * reach + 1
    depth = anc.sum(-1) - 1
    return DraftTree(tokens=tokens, parents=parents, depth=depth,
                     positions=prefix_lens.view(b, 1).to(dev) + depth, mask=anc, scores=scores,
                     draft_probs=probs)


_EYES: dict[tuple[int, str, bool], torch.Tensor] = {}


def _eye(n: int, dev: torch.device) -> torch.Tensor:
    """(n, n) bool identity, built once per (n, device) (callers copy before writing)."""
    key = (n, str(dev), torch.is_inference_mode_enabled())
    e = _EYES.get(key)
    if e is None:
        if len(_EYES) > 64:
            _EYES.clear()
        e = _EYES[key] = torch.eye(n, dtype=torch.bool, device=dev)
    return e
