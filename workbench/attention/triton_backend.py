"""Paged attention through the Triton ``tree_attention`` kernel, with PagedAttention's plan/run.

``plan`` (once per forward) turns the engine's per-request slot lists into the kernel's ragged
index tensors; ``run`` (every layer) writes the new K/V into the pool and
launches one kernel for the whole ragged batch. No per-layer gather: the kernel reads K/V by slot
id straight from the pool.

Two modes share one object:

* eager — ``plan`` builds fresh tensors sized to this forward (prefill, decode, draft extend,
  tree verify);
* static — :meth:`TritonTreeAttention.static` preallocates fixed-address buffers for a batch
  bucket (``batch`` requests × ``q_len`` tokens, keys up to ``max_kv``) and :meth:`plan_static`
  fills them in place, so a CUDA graph captured over :meth:`run` replays with new inputs
  (``workbench.engine.cuda_graphs``). Padding rows repeat request 0 (see ``pad_rows``).

Symbols (DESIGN.md): B requests, T new tokens, H/Hkv heads, hd head dim, S pool slots, L layers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Stage = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None]  # (device dst, host src)


def copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair, in order, on the current stream."""
    for dst, src in copies:
        dst.copy_(src, non_blocking=True)


@dataclass
class RaggedPlan:
    """Host-side (CPU) index tensors of one forward, in the kernel's ragged format."""

    write_slots: torch.Tensor  # (T,) int64: slot of each new token, in token order
    qo_indptr: torch.Tensor  # (B+1,) int64: request b owns query rows [qo_indptr[b], [b+1])
    kv_indices: torch.Tensor  # (B, Lk_max) int64: slots of positions [0, kv_len_b), 0-padded
    kv_lens: torch.Tensor  # (B,) int64
    mask: torch.Tensor | None  # (B, Lq_max, Lk_max) bool, or None = causal at the end
    q_lens: list[int]
    max_q_len: int


def check_plan_args(write_slots: torch.Tensor, q_lens: list[int],
                    kv_slots: list[torch.Tensor],
                    tree_masks: list[torch.Tensor | None] | None) -> None:
    """Metadata-only checks (no device reads): the plan contract shared by every backend."""
    if not q_lens or len(q_lens) != len(kv_slots):
        raise ValueError(f"plan: {len(q_lens)} q_lens for {len(kv_slots)} kv_slots lists")
    if tree_masks is not None and len(tree_masks) != len(q_lens):
        raise ValueError(f"plan: {len(tree_masks)} tree masks for {len(q_lens)} requests")
    if int(write_slots.numel()) != sum(q_lens):
        raise ValueError(f"plan: write_slots has {write_slots.numel()} slots for "
                         f"{sum(q_lens)} new tokens")
    for b, (q, s) in enumerate(zip(q_lens, kv_slots, strict=True)):
        if q < 1 or int(s.numel()) < q:
            raise ValueError(f"plan: request {b} has q_len {q} and {s.numel()} kv slots "
                             "(need 1 <= q_len <= kv_len)")
        tm = tree_masks[b] if tree_masks is not None else None
        if tm is not None and tuple(tm.shape) != (q, q):
            raise ValueError(f"plan: tree mask {b} has shape {tuple(tm.shape)}, "
                             f"expected ({q}, {q})")


def has_tree(tree_masks: list[torch.Tensor | None] | None) -> bool:
    return tree_masks is not None and any(m is not None for m in tree_masks)


def block_mask(q_lens: list[int], kv_lens: list[int],
               tree_masks: list[torch.Tensor | None] | None, lq: int, lk: int) -> torch.Tensor:
    """(B, lq, lk) bool: row i of request b sees its prefix [0, kv_b - q_b) and, over its new
    tokens, either its tree mask (ancestors and itself) or the causal triangle. Rows >= q_b and
    columns >= kv_b are False (no kernel reads them)."""
    mask = torch.zeros(len(q_lens), lq, lk, dtype=torch.bool, device="cpu")
    for b, (q, n) in enumerate(zip(q_lens, kv_lens, strict=True)):
        pre = n - q
        mask[b, :q, :pre] = True
        tm = tree_masks[b] if tree_masks is not None else None
        mask[b, :q, pre:n] = torch.ones(q, q, dtype=torch.bool, device="cpu").tril() if tm is None \
            else tm.to(device="cpu", dtype=torch.bool)
    return mask


def ragged_plan(write_slots: torch.Tensor, q_lens: list[int], kv_slots: list[torch.Tensor],
                tree_masks: list[torch.Tensor | None] | None = None) -> RaggedPlan:
    """Build the kernel's index tensors on the host. Arguments as ``PagedAttention.plan``."""
    check_plan_args(write_slots, q_lens, kv_slots, tree_masks)
    kv_lens = [int(s.numel()) for s in kv_slots]
    lk, lq = max(kv_lens), max(q_lens)
    kv_indices = torch.stack([F.pad(s.to("cpu", torch.int64), (0, lk - n))
                              for s, n in zip(kv_slots, kv_lens, strict=True)])
    qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int64, device="cpu")
    qo_indptr[1:] = torch.tensor(q_lens, device="cpu").cumsum(0)
    mask = block_mask(q_lens, kv_lens, tree_masks, lq, lk) if has_tree(tree_masks) else None
    lens = torch.tensor(kv_lens, dtype=torch.int64, device="cpu")
    return RaggedPlan(write_slots.to("cpu", torch.int64), qo_indptr, kv_indices, lens, mask,
                      list(q_lens), lq)


def pad_rows(n_real: int, batch: int, q_len: int) -> torch.Tensor:
    """(batch·q_len,) int64 source row of every token of a padded bucket.

    Real requests map to themselves; padding requests repeat request 0 token for token. Their
    K/V writes then go to request 0's slots with request 0's values (``run`` gathers K/V through
    this index before the scatter), so duplicate slots in one index_copy_ carry identical bits
    and the pool ends up exactly as without padding."""
    rows = torch.arange(batch * q_len, device="cpu").view(batch, q_len)
    rows[n_real:] = rows[0]
    return rows.flatten()


class TritonTreeAttention:
    """Backend for one pool (target: L layers; draft: one layer) on the Triton kernel.

    Memory traffic per layer: write T·Hkv·hd·2 values; read Σ_b kv_len_b·Hkv·hd·2 once per kv
    head group (no gather copy), plus B·Lq·Lk mask bytes in tree mode.
    """

    name = "triton"
    # kv_slots may be any slot list (a draft with holes): see DraftState.slots
    arbitrary_slots = True

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int, *,
                 kernel: Literal["triton", "reference"] = "triton") -> None:
        """kernel="reference" runs the kernel's torch specification instead (same contract,
        reads values, not capturable): CPU tests of the static path use it for speed."""
        device = k_pool.device
        if kernel == "reference":
            from workbench.kernels.reference import tree_attention as fn
        elif kernel == "triton":
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(f"triton attention backend on {device.type} needs "
                                   "TRITON_INTERPRET=1 set before triton is first imported")
            # Fails here (the attention_backend init stage) when triton is missing.
            from workbench.kernels.triton_tree_attention import tree_attention_triton as fn
        else:
            raise ValueError(f"kernel: {kernel!r} not in triton/reference")
        self._kernel = fn
        self.kernel = kernel
        self.k_pool, self.v_pool = k_pool, v_pool  # (L, S, Hkv, hd)
        self.h = num_heads
        self.device = device
        self.sm_scale = float(k_pool.shape[-1]) ** -0.5
        empty = torch.empty(0, dtype=torch.int64, device=device)
        self.write_slots = empty
        self.qo_indptr = torch.zeros(2, dtype=torch.int64, device=device)
        self.kv_indices = torch.empty(1, 0, dtype=torch.int64, device=device)
        self.kv_lens = torch.zeros(1, dtype=torch.int64, device=device)
        self.mask: torch.Tensor | None = None
        self.max_q_len = 1
        self.row_src: torch.Tensor | None = None  # static mode only: see pad_rows
        self.static_shape: tuple[int, int, int] | None = None  # (batch, q_len, max_kv)

    # -- eager ---------------------------------------------------------------------------
    def plan(self, write_slots: torch.Tensor, q_lens: list[int], kv_slots: list[torch.Tensor],
             tree_masks: list[torch.Tensor | None] | None = None) -> None:
        """Same contract as ``PagedAttention.plan``: write_slots (T,), q_lens per request,
        kv_slots per request (kv_len_b,) = prefix slots then the new tokens' slots, tree_masks
        per request (q_len, q_len) bool or None (causal)."""
        if self.static_shape is not None:
            raise RuntimeError("plan: this backend is static (graph) mode; use plan_static")
        p = ragged_plan(write_slots, q_lens, kv_slots, tree_masks)
        dev = self.device
        self.write_slots = p.write_slots.to(dev, non_blocking=True)
        self.qo_indptr = p.qo_indptr.to(dev, non_blocking=True)
        self.kv_indices = p.kv_indices.to(dev, non_blocking=True)
        self.kv_lens = p.kv_lens.to(dev, non_blocking=True)
        self.mask = None if p.mask is None else p.mask.to(dev, non_blocking=True)
        self.max_q_len = p.max_q_len

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, hd), k/v (T, Hkv, hd) → (T, H, hd). Sync-free (graph-capturable)."""
        kp, vp = self.k_pool[layer], self.v_pool[layer]
        if self.row_src is not None:
            k, v = k.index_select(0, self.row_src), v.index_select(0, self.row_src)
        kp.index_copy_(0, self.write_slots, k)
        vp.index_copy_(0, self.write_slots, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        return self._kernel(q, kp, vp, self.qo_indptr, self.kv_indices, self.kv_lens, self.mask,
                            self.sm_scale, max_q_len=self.max_q_len)

    # -- static (CUDA graphs) ----------------------------------------------------------------
    @classmethod
    def static(cls, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int, batch: int,
               q_len: int, max_kv: int, kernel: Literal["triton", "reference"] = "triton"
               ) -> TritonTreeAttention:
        """A backend whose index tensors live at fixed addresses: ``batch`` requests of exactly
        ``q_len`` new tokens each (1 = decode, N = tree verify with masks), kv_len <= max_kv.

        Buffers: write_slots, row_src (batch·q_len,); kv_indices (batch, max_kv); kv_lens
        (batch,); mask (batch, q_len, max_kv) bool when q_len > 1."""
        self = cls(k_pool, v_pool, num_heads, kernel=kernel)
        dev = self.device
        n = batch * q_len
        self.static_shape = (batch, q_len, max_kv)
        self.write_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.row_src = torch.arange(n, dtype=torch.int64, device=dev)
        self.qo_indptr = torch.arange(0, n + 1, q_len, dtype=torch.int64, device=dev)
        self.kv_indices = torch.zeros(batch, max_kv, dtype=torch.int64, device=dev)
        self.kv_lens = torch.full((batch,), q_len, dtype=torch.int64, device=dev)
        self.mask = torch.zeros(batch, q_len, max_kv, dtype=torch.bool, device=dev) \
            if q_len > 1 else None
        self.max_q_len = q_len
        return self

    def plan_static(self, p: RaggedPlan, stage: Stage | None = None) -> None:
        """Copy a host plan of ``n_real <= batch`` requests of q_len tokens into the fixed
        buffers, padding with copies of request 0. Outside the graph; no reallocation.
        ``stage`` performs the (device dst, host src) copies (default: in order, on the current
        stream; ``Overlap.stage`` makes them asynchronous)."""
        assert self.static_shape is not None and self.row_src is not None
        batch, q_len, max_kv = self.static_shape
        b = len(p.q_lens)
        lk = int(p.kv_indices.shape[1])
        if b > batch or any(q != q_len for q in p.q_lens) or lk > max_kv:
            raise ValueError(f"plan_static: {b} requests, q_lens {sorted(set(p.q_lens))}, "
                             f"kv up to {lk} do not fit the bucket {self.static_shape}")
        rows = pad_rows(b, batch, q_len)
        req = rows.view(batch, q_len)[:, 0] // q_len  # source request of each bucket row
        # Only the first lk key columns are read (kv_len <= lk); the rest keep stale values.
        copies = [(self.write_slots, p.write_slots[rows]), (self.row_src, rows),
                  (self.kv_indices[:, :lk], p.kv_indices[req]), (self.kv_lens, p.kv_lens[req])]
        if self.mask is not None:
            mask = p.mask if p.mask is not None else block_mask(  # causal over q_len tokens
                p.q_lens, p.kv_lens.tolist(), None, q_len, lk)
            copies.append((self.mask[:, :, :lk], mask[req]))
        (stage or copy_all)(copies)
