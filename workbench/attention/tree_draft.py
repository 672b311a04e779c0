"""Draft-tree attention for the drafter (:func:`workbench.speculative.drafter.draft_tree`).

Not a pool backend: it reads the draft pool once per draft phase (each request's prefix) and
keeps the tree's own K/V in a local buffer, so rejected branches never touch the draft's KV.
One request whose prefix and the room after it are one run of the pool reads it as a view
instead (no gather; the tree's K/V go to that room, past the draft's prefix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence


class TreeDraftAttention:
    """Draft-tree attention: gathered draft prefix (once per draft phase) + tree-local K/V.

    Prefix and tree entries share one buffer of Lp + ``max_tree`` rows, filled depth by depth
    (nothing is re-concatenated per depth). Tree nodes never reach the draft's KV: they go to
    the local buffer, or (one request over a run of the pool) to the scratch slots after its
    prefix, positions the draft has not seen and the next draft extend overwrites; rejected
    branches therefore need no rewind.
    """

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int,
                 prefix_slots: list[torch.Tensor] | tuple[int, int], max_tree: int) -> None:
        """``max_tree``: tree entries the draft phase adds, (S−1)·K. ``prefix_slots``: per
        request the pool slots of its prefix; or ``(lo, n)`` for one request whose prefix is
        the pool's slots [lo, lo + n) and whose next ``max_tree`` slots are its own scratch
        (``KVPool.run`` over prefix and tree; positions the draft has not seen, which the next
        draft extend overwrites): the buffer is then that view of the pool, nothing gathered,
        and the tree's K/V land in the scratch slots."""
        dev = k_pool.device  # prefix slots arrive on the host (KVPool.slots)
        if isinstance(prefix_slots, tuple):
            lo, lk = prefix_slots
            if lo < 0 or lo + lk + max_tree > k_pool.shape[1]:
                raise ValueError(f"TreeDraftAttention: run [{lo}, {lo + lk + max_tree}) outside "
                                 f"the pool's {k_pool.shape[1]} slots")
            lens = [lk]
            self.k_buf = k_pool[0:1, lo : lo + lk + max_tree]  # (1, Lp + cap, Hkv, hd) views
            self.v_buf = v_pool[0:1, lo : lo + lk + max_tree]
        else:
            lens = [int(s.numel()) for s in prefix_slots]
            lk = max(lens)
            self._gather(k_pool, v_pool, prefix_slots, lk, max_tree)
        b = len(lens)
        # one request: its (L, Hkv, hd) rows, which the flat (K, Hkv, hd) k/v go to directly
        self.k_one: torch.Tensor | None = self.k_buf[0] if b == 1 else None
        self.v_one: torch.Tensor | None = self.v_buf[0] if b == 1 else None
        # SDPA's (B, Hkv, L, hd) views of the buffers, sliced to the entries written so far
        self.k_t, self.v_t = self.k_buf.transpose(1, 2), self.v_buf.transpose(1, 2)
        # which prefix rows are real (the rest pad shorter prefixes); None: all of them (one
        # request, or prefixes of one length)
        self.pre_valid = None if min(lens) == lk \
            else torch.arange(lk, device=dev) < torch.tensor(lens, device=dev).view(b, 1)
        self.dev = dev
        self.lp, self.n_tree, self.cap = lk, 0, max_tree
        # (B, K, Lp + cap) additive, in the queries' dtype: 0 where a query may look, -inf
        # where not (what SDPA makes of a bool mask, once per forward); built at the first run
        self.mask_buf: torch.Tensor | None = None
        self.fill: tuple[torch.Tensor, torch.Tensor] | None = None  # (0, -inf) for bool anc
        self.b, self.h = b, num_heads
        self.gqa = num_heads != k_pool.shape[2]
        self.anc: torch.Tensor | None = None  # (B, K, n_tree) ancestors-or-self of the frontier

    def _gather(self, k_pool: torch.Tensor, v_pool: torch.Tensor, prefix_slots: list[torch.Tensor],
                lk: int, max_tree: int) -> None:
        """The prefixes gathered straight into a fresh buffer (one copy, not gather + cat),
        shorter ones padded with slot 0 (masked out: ``pre_valid``)."""
        b = len(prefix_slots)
        idx = prefix_slots[0] if b == 1 else pad_sequence(prefix_slots, batch_first=True).flatten()
        if idx.device != k_pool.device:
            idx = idx.to(k_pool.device)
        self.k_buf = k_pool.new_empty(b, lk + max_tree, *k_pool.shape[2:])
        self.v_buf = v_pool.new_empty(b, lk + max_tree, *v_pool.shape[2:])
        if b == 1:
            torch.index_select(k_pool[0], 0, idx, out=self.k_buf[0, :lk])
            torch.index_select(v_pool[0], 0, idx, out=self.v_buf[0, :lk])
        else:
            self.k_buf[:, :lk] = k_pool[0].index_select(0, idx).view(b, lk, *k_pool.shape[2:])
            self.v_buf[:, :lk] = v_pool[0].index_select(0, idx).view(b, lk, *v_pool.shape[2:])

    def set_frontier(self, anc: torch.Tensor) -> None:
        """anc (B, K, n_tree_after_this_step): which tree entries each query may see, as bool
        or as a float additive mask (0 where it may, -inf where not: copied as it is)."""
        self.anc = anc

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B·K, H, hd), k/v (B·K, Hkv, hd) for the frontier → (B·K, H, hd)."""
        assert self.anc is not None
        b = self.b
        kq = k.shape[0] // b
        if kq * b != k.shape[0]:
            raise ValueError(f"TreeDraftAttention: {k.shape[0]} frontier rows for {b} requests")
        if self.n_tree + kq > self.cap:
            raise ValueError(f"TreeDraftAttention: {self.n_tree + kq} tree entries > max_tree "
                             f"{self.cap}")
        lo, n = self.lp + self.n_tree, self.lp + self.n_tree + kq
        if self.k_one is not None and self.v_one is not None:
            self.k_one[lo:n] = k
            self.v_one[lo:n] = v
        else:
            self.k_buf[:, lo:n] = k.view(b, kq, *k.shape[1:])
            self.v_buf[:, lo:n] = v.view(b, kq, *v.shape[1:])
        self.n_tree += kq
        if self.mask_buf is None or self.mask_buf.shape[1] != kq:
            # the prefix columns as pre_valid, the tree's written below before they are read
            self.mask_buf = q.new_zeros(b, kq, self.lp + self.cap)
            if self.pre_valid is not None:
                self.mask_buf[:, :, : self.lp].masked_fill_(~self.pre_valid.unsqueeze(1),
                                                            float("-inf"))
        tree = self.mask_buf[:, :, self.lp : n]
        if self.anc.dtype == torch.bool:
            if self.fill is None:
                self.fill = (q.new_zeros(()), q.new_full((), float("-inf")))
            torch.where(self.anc, *self.fill, out=tree)
        else:
            tree.copy_(self.anc)
        o = F.scaled_dot_product_attention(
            q.view(b, kq, *q.shape[1:]).transpose(1, 2), self.k_t[:, :, :n], self.v_t[:, :, :n],
            attn_mask=self.mask_buf[:, :, :n].unsqueeze(1),
            enable_gqa=self.gqa)
        return o.transpose(1, 2).reshape(b * kq, *q.shape[1:])
