"""Preallocated paged KV pool. Slot of (request, position p) = blocks[p // page] * page + p % page.

One block table per request serves both the target pool (L layers) and the draft pool (one
layer): the draft's entry for position p lives in the same slot. Nothing is reallocated after
init; acceptance compacts by index.

A latent-attention target (DeepSeek-V3's MLA) caches one shared "head" per token and layer, the
latent followed by the rope key; its value is the latent itself, so ``v`` is a view of ``k``'s
first ``v_dim`` columns (``v_dim`` given): the pool stores the latent once.
"""

from __future__ import annotations

from array import array

import torch

from workbench.errors import KVExhausted


class KVPool:
    """k/v: (L, num_slots, Hkv, hd) preallocated; a free list of page-sized blocks.
    ``v_dim``: values are ``k[..., :v_dim]`` (a view; latent attention), not a second pool."""

    def __init__(self, num_blocks: int, page_size: int, layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str,
                 draft_shape: tuple[int, int] | None = None, v_dim: int | None = None) -> None:
        self.page_size = page_size
        self.num_blocks = num_blocks
        slots = num_blocks * page_size
        if v_dim is not None and not 0 < v_dim <= head_dim:
            raise ValueError(f"KVPool.v_dim: {v_dim} not in (0, head_dim={head_dim}]")
        self.v_shares_k = v_dim is not None
        # keys and values as the two halves of one tensor (each contiguous): the CPU
        # compaction (kernels.reference.compact_kv) moves both in one gather and one scatter
        self.kv: torch.Tensor | None = None
        if v_dim is None:
            self.kv = torch.zeros(2, layers, slots, kv_heads, head_dim, dtype=dtype,
                                  device=device)
            self.k, self.v = self.kv[0], self.kv[1]
        else:
            self.k = torch.zeros(layers, slots, kv_heads, head_dim, dtype=dtype, device=device)
            self.v = self.k[..., :v_dim]
        if draft_shape is not None:
            self.dk: torch.Tensor | None = torch.zeros(1, slots, *draft_shape, dtype=dtype,
                                                       device=device)
            self.dv: torch.Tensor | None = torch.zeros_like(self.dk)
        else:
            self.dk = self.dv = None
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def nbytes(self) -> int:
        n = self.k.nbytes + (0 if self.v_shares_k else self.v.nbytes)
        if self.dk is not None and self.dv is not None:
            n += self.dk.nbytes + self.dv.nbytes
        return n

    def blocks_needed(self, have: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(have))

    def can_fit(self, have: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(have, num_tokens) <= len(self.free)

    def reserve(self, blocks: list[int], num_tokens: int) -> None:
        """Grow ``blocks`` in place to cover ``num_tokens`` positions (caller checked can_fit;
        KVExhausted otherwise, with ``blocks`` unchanged)."""
        need = self.blocks_needed(blocks, num_tokens)
        if need > len(self.free):
            raise KVExhausted(need, len(self.free))
        for _ in range(need):
            blocks.append(self.free.pop())

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))
        blocks.clear()

    def trim(self, blocks: list[int], num_tokens: int) -> None:
        """Return blocks beyond ``num_tokens`` positions (after rejected lookahead)."""
        keep = -(-num_tokens // self.page_size)
        while len(blocks) > keep:
            self.free.append(blocks.pop())

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Slot ids of positions [start, end): (end - start,) int64, on the host.

        Host on purpose: slots are plan metadata, and every attention backend plans on the host
        (``ragged_plan``, ``page_table``) and copies the finished plan to the device once;
        building them on the GPU would cost a device→host sync per request.

        Blocks covering [start, end) that are one ascending run (the free list hands them out
        so; a lone stream nearly always has them) are one ``arange``: 2 vs 13 µs per call on
        the 2-core EPYC, paid 1 (plain) to 5 (speculative) times per step."""
        lo = self.run(blocks, start, end)
        if lo is not None:
            return torch.arange(lo, lo + end - start, device="cpu")
        pos = torch.arange(start, end, device="cpu")
        table = torch.tensor(blocks, dtype=torch.int64, device="cpu")
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def run(self, blocks: list[int], start: int, end: int) -> int | None:
        """The slot of position ``start`` when the slots of [start, end) are one ascending run
        of ``blocks`` (``slots`` is then ``arange(lo, lo + end - start)``), else None (also
        when ``blocks`` do not reach ``end``): host ints only, for a plan that attends to a
        view of the pool (PagedAttention.plan_run, TreeDraftAttention)."""
        page = self.page_size
        if end <= start or (end - 1) // page >= len(blocks):
            return None  # empty, or beyond the request's blocks
        b0, b1 = start // page, (end - 1) // page
        first = blocks[b0]
        if all(blocks[b0 + i] == first + i for i in range(1, b1 - b0 + 1)):
            return (first - b0) * page + start
        return None

    def slot_list(self, blocks: list[int], start: int, end: int) -> list[int]:
        """:meth:`slots` as host ints, for callers that read them on the host (no tensor)."""
        page = self.page_size
        return [blocks[p // page] * page + p % page for p in range(start, end)]

    def compact(self, src: torch.Tensor | list[int], dst: torch.Tensor | list[int]) -> None:
        """Move accepted-path KV into place in every target layer: pool[:, dst] = pool[:, src].
        Host lists (the engine's commit) become one index buffer, and the kernel's value check
        reads the lists rather than the tensors."""
        from workbench.kernels import compact_kv

        host = None
        if isinstance(src, list) or isinstance(dst, list):
            if not (isinstance(src, list) and isinstance(dst, list)) or len(src) != len(dst):
                raise ValueError("KVPool.compact: src and dst must be host lists of one length")
            if not src:
                return
            host = (src, dst)
            idx = torch.frombuffer(array("q", src + dst), dtype=torch.int64)
            src, dst = idx[: len(host[0])], idx[len(host[0]) :]
        if src.device != self.k.device:  # (a no-op .to is still a dispatch per call)
            src, dst = src.to(self.k.device), dst.to(self.k.device)
        if self.v_shares_k:  # one pool: gather (a copy), then scatter
            self.k.index_copy_(1, dst, self.k.index_select(1, src))
            return
        compact_kv(self.k, self.v, src, dst, host)
