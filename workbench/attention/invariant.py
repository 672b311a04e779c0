"""The ``invariant`` backend: attention over the paged pool in which every query row's result
is bit-identical whatever else is in the forward (``EngineConfig(batch_invariant=True)``, the
CPU engine's row-invariant numerics; docs/REFERENCE.md §3).

``plan`` turns each request's slots into per-row key lists
(:func:`~workbench.kernels.cpu_row_attention.plan_rows`): a causal row attends to its
request's slots up to itself, a tree row to the prefix and then its ancestors and itself, in
position order, so a verify row sees the very key list, in the same order, that the same
token decoded alone sees. ``run`` writes the new K/V and calls the C row kernel, whose every
reduction has a fixed order (``kernels/csrc/row_attention.c``). No padding, no masks, no
length groups: nothing about the batch reaches a row.
"""

from __future__ import annotations

import torch

from workbench.kernels.cpu_row_attention import RowPlan, plan_rows, row_attention


class RowInvariantAttention:
    """Backend for one pool (target: L layers; draft: one layer) on the CPU.

    Memory traffic per layer: write T·Hkv·hd·2 values; read Σ_rows n_row·Hkv·hd·2 (each row's
    own keys and values; the rows of one request share its prefix in cache)."""

    name = "invariant"
    arbitrary_slots = True

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int) -> None:
        if k_pool.device.type != "cpu":
            raise ValueError(f"the invariant attention backend runs on the CPU; the pool is on "
                             f"{k_pool.device}")
        if k_pool.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the invariant attention backend reads float32 or bfloat16 KV; "
                             f"the pool is {k_pool.dtype}")
        if num_heads % k_pool.shape[2]:
            raise ValueError(f"query heads {num_heads} not a multiple of KV heads "
                             f"{k_pool.shape[2]}")
        self.k_pool, self.v_pool = k_pool, v_pool  # (L, S, Hkv, hd)
        self.h = num_heads
        self.device = k_pool.device
        self.write_slots = torch.empty(0, dtype=torch.int64, device="cpu")
        self.rows: RowPlan | None = None

    def plan(self, write_slots: torch.Tensor, q_lens: list[int], kv_slots: list[torch.Tensor],
             tree_masks: list[torch.Tensor | None] | None = None) -> None:
        """See :class:`~workbench.attention.AttentionBackend`; the key lists are built here,
        once per forward, and read by every layer."""
        self.write_slots = write_slots.to(self.device, torch.int64)
        self.rows = plan_rows(q_lens, kv_slots, tree_masks)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, hd), k/v (T, Hkv, hd) → (T, H, v's hd) in q's dtype."""
        if self.rows is None:
            raise RuntimeError("RowInvariantAttention.run before plan")
        kp, vp = self.k_pool[layer], self.v_pool[layer]
        kp.index_copy_(0, self.write_slots, k)
        if vp.data_ptr() != kp.data_ptr():  # a latent pool's values are its keys' first columns
            vp.index_copy_(0, self.write_slots, v)
        return row_attention(q, kp, vp, self.rows).to(q.dtype)
