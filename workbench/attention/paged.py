"""The ``torch`` backend: attention over the paged pool by gather + SDPA (the CPU path), with
the plan/run split every backend shares.

``plan`` runs once per forward: it turns per-request query/KV lengths (and an optional tree
mask) into static index tensors. ``run`` is called by every layer: write the new K/V into their
slots, gather each request's keys, one SDPA call per length group of the ragged batch.

Length groups. One SDPA call pads every request's keys to the batch's longest context (and its
query rows to the longest query), so a few long requests multiply the attention of all the short
ones beside them (measured on the 2-core EPYC, one thread: 31 verify trees over 40 keys beside 4
over 163 keys, 4.6 ms per layer as one call, 0.9 ms as two). :func:`length_groups` splits the
batch into groups of similar key length, each attended by its own call over keys padded to its
own longest; a batch that stays one group runs as it always did. A request's rows are its rows
in a batch of its group alone: float32 SDPA rounds a row's last bits by the length its keys are
padded to (docs/REFERENCE.md §3), not by which other requests share the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.attention.triton_backend import has_tree

# causal masks of at most this many new rows (draft extends, short chunks) are views of one
# buffer per row count (PagedAttention._wide_causal): no op per forward to build them
WIDE_CAUSAL_ROWS = 16
# length_groups' cost of a group: requests × longest keys × (longest query + GATHER_ROWS) (the
# SDPA's query-key pairs, and the keys' gather, which costs about what four query rows do), plus
# GROUP_OVERHEAD per call (~30 µs per layer: its gathers, SDPA, the query and output copies;
# about what 1,500 of those units cost). Measured on the 2-core EPYC, one thread.
GATHER_ROWS = 4
GROUP_OVERHEAD = 1500


def length_groups(q_lens: list[int], k_lens: list[int],
                  overhead: int = GROUP_OVERHEAD) -> list[list[int]]:
    """The batch's requests (indices) in groups attended by one SDPA call each: runs of the
    requests ordered by key length, chosen to minimise the sum over groups of requests ×
    longest keys × (longest query + GATHER_ROWS) + ``overhead`` (exact; O(B²) on host ints).
    Each group lists its requests in batch order; the groups by ascending key length."""
    b = len(q_lens)
    order = sorted(range(b), key=lambda i: (k_lens[i], i))
    best = [0] * (b + 1)
    cut = [0] * (b + 1)
    for j in range(1, b + 1):
        lk, mq = k_lens[order[j - 1]], 0
        best_j, cut_j = -1, 0
        for i in range(j - 1, -1, -1):  # the last group: order[i:j]
            mq = max(mq, q_lens[order[i]])
            c = best[i] + (j - i) * lk * (mq + GATHER_ROWS) + overhead
            if best_j < 0 or c < best_j:
                best_j, cut_j = c, i
        best[j], cut[j] = best_j, cut_j
    groups: list[list[int]] = []
    j = b
    while j > 0:
        groups.append(sorted(order[cut[j] : j]))
        j = cut[j]
    groups.reverse()
    return groups


class _Group:
    """One length group's plan: the forward's query rows of its requests (``rows``), its keys'
    slots padded to its longest (``kv_flat``, ``kv_shape`` = (requests, keys)), its padded query
    layout (``q_shape``; ``q_index``: where its real rows sit, None when none is padded) and
    its mask (``mask``, ``is_causal``)."""

    __slots__ = ("is_causal", "kv_flat", "kv_shape", "mask", "q_index", "q_shape", "rows")

    def __init__(self, rows: torch.Tensor, kv_flat: torch.Tensor, kv_shape: tuple[int, int],
                 q_shape: tuple[int, int], q_index: torch.Tensor | None,
                 mask: torch.Tensor | None, is_causal: bool) -> None:
        self.rows, self.kv_flat, self.kv_shape = rows, kv_flat, kv_shape
        self.q_shape, self.q_index, self.mask, self.is_causal = q_shape, q_index, mask, is_causal


class PagedAttention:
    """Backend for one pool (target: L layers; draft: one layer).

    Memory traffic per layer: write T·Hkv·hd·2 values; read B·Lk·Hkv·hd·2 (the gather) —
    dominated by the gather at long contexts.
    """

    name = "torch"
    # kv_slots may be any slot list (a draft with holes): see DraftState.slots
    arbitrary_slots = True

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int) -> None:
        self.k_pool, self.v_pool = k_pool, v_pool  # (L, S, Hkv, hd)
        self.h = num_heads
        self.gqa = num_heads != k_pool.shape[2]
        dev = self.device = k_pool.device  # plans arrive on the host (KVPool.slots): moved here
        self.write_slots = torch.empty(0, dtype=torch.int64, device=dev)
        self._no_slots = self.write_slots  # a plan_run's: it writes through views
        self.kv_index = torch.empty(0, 0, dtype=torch.int64, device=dev)
        self.kv_flat = torch.empty(0, dtype=torch.int64, device=dev)
        self.mask: torch.Tensor | None = None
        self.q_index: torch.Tensor | None = None
        self.q_shape = (0, 0)
        self.is_causal = False
        self.span_k: torch.Tensor | None = None  # (L, 1, Hkv, Lk, hd) views of the pool
        self.span_v: torch.Tensor | None = None
        self.run_k: torch.Tensor | None = None  # (L, T, Hkv, hd) views: the new tokens' slots
        self.run_v: torch.Tensor | None = None
        self.groups: list[_Group] | None = None  # length groups (None: one call for the batch)
        self._tril: dict[int, torch.Tensor] = {}  # additive causal (q, q) blocks by q
        self._wide: dict[int, torch.Tensor] = {}  # _wide_causal's buffers by q
        # Reduced precision on the CPU: SDPA runs in float32. Its bf16 kernel rounds a masked
        # tree row differently from the same row decoded alone, and the speculative output
        # must equal the baseline's at every dtype (tests/speculative/test_bf16_lossless.py:
        # 9 of 16 cases differed with bf16 SDPA, none with float32). Float32 SDPA still
        # differs in its last bits between batch shapes (docs/REFERENCE.md §3), and rounding
        # its output to bf16 can turn that into a token flip at a near-tie: measured rates in
        # docs/PERFORMANCE.md §6b. The pool stays in the model's dtype.
        reduced = k_pool.dtype in (torch.bfloat16, torch.float16) and dev.type == "cpu"
        self.sdpa_dtype = torch.float32 if reduced else k_pool.dtype

    def plan(self, write_slots: torch.Tensor, q_lens: list[int], kv_slots: list[torch.Tensor],
             tree_masks: list[torch.Tensor | None] | None = None) -> None:
        """write_slots (T,) slots of the new tokens (in order); q_lens per request; kv_slots per
        request (Lk_b,) = prefix slots followed by the new tokens' slots; tree_masks per request
        (q_len, q_len) bool ancestor mask over the new tokens, or None for causal."""
        b = len(q_lens)
        lq, lk = max(q_lens), max(int(s.numel()) for s in kv_slots)
        dev = self.device
        self.write_slots = write_slots if write_slots.device == dev else write_slots.to(dev)
        self.q_shape = (b, lq)
        uniform = all(q == lq for q in q_lens) and all(int(s.numel()) == lk for s in kv_slots)
        # One request whose slots are one run (the allocator hands out ascending blocks, so a
        # lone stream usually has them): plan_run. The run check on host ints: one list read
        # instead of four tensor ops, which cost ~25 µs each right after a forward has pushed
        # torch's dispatch out of the caches (the engine asks KVPool.run first: no tensors)
        host = kv_slots[0].tolist() if b == 1 and lk > 1 else None
        if host is not None and host[-1] - host[0] == lk - 1 and \
                host == list(range(host[0], host[0] + lk)):
            self.plan_run(host[0], lk, lq, tree_masks[0] if tree_masks is not None else None)
            return
        self.span_k = self.span_v = self.run_k = self.run_v = None
        self.groups = None
        if not uniform:
            groups = length_groups(q_lens, [int(s.numel()) for s in kv_slots])
            if len(groups) > 1:
                self.groups = self._plan_groups(groups, q_lens, kv_slots, tree_masks)
                return
        self.kv_index, self.q_index, self.mask, self.is_causal = self._plan_batch(
            q_lens, kv_slots, tree_masks, uniform)
        self.kv_flat = self.kv_index.flatten()

    def _plan_groups(self, groups: list[list[int]], q_lens: list[int],
                     kv_slots: list[torch.Tensor],
                     tree_masks: list[torch.Tensor | None] | None) -> list[_Group]:
        """Each length group planned as a batch of its requests alone (:meth:`_plan_batch`),
        with the forward's query rows of its requests."""
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        out = []
        for g in groups:
            ql, kv = [q_lens[i] for i in g], [kv_slots[i] for i in g]
            tm = None if tree_masks is None else [tree_masks[i] for i in g]
            lq, lk = max(ql), max(int(s.numel()) for s in kv)
            uniform = all(q == lq for q in ql) and all(int(s.numel()) == lk for s in kv)
            kv_index, q_index, mask, causal = self._plan_batch(ql, kv, tm, uniform)
            rows = torch.tensor([r for i in g for r in range(starts[i], starts[i + 1])],
                                dtype=torch.int64, device=self.device)
            out.append(_Group(rows, kv_index.flatten(), (len(g), lk), (len(g), lq), q_index,
                              mask, causal))
        return out

    def _plan_batch(self, q_lens: list[int], kv_slots: list[torch.Tensor],
                    tree_masks: list[torch.Tensor | None] | None, uniform: bool,
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
        """One SDPA call's plan for these requests: (kv_index (B, Lk) padded with slot 0,
        q_index of the real rows in the padded (B·Lq) layout or None, mask, is_causal)."""
        b, dev = len(q_lens), self.device
        lq, lk = max(q_lens), max(int(s.numel()) for s in kv_slots)
        kv_index = torch.stack(kv_slots) if uniform else torch.stack(
            [F.pad(s, (0, lk - int(s.numel()))) for s in kv_slots])
        kv_index = kv_index.to(dev)
        q_index = None if uniform else torch.cat(
            [torch.arange(q, device=dev) + i * lq for i, q in enumerate(q_lens)])
        tree = has_tree(tree_masks)
        # Fast paths: one new token per request with no padding needs no mask at all; a single
        # fresh prefill is plain causal attention.
        if uniform and not tree and lq == 1:
            return kv_index, q_index, None, False
        if b == 1:
            return (kv_index, q_index,
                    *self._one_mask(lq, lk, tree_masks[0] if tree_masks is not None else None))
        # Additive float mask (0 / -inf), built once per forward: SDPA turns a bool mask into
        # exactly this on every call (so the outputs are bit-identical), ~3 µs per layer at
        # T=16 (measured on the 2-core EPYC: 58 vs 61 µs per verify-shaped call). Built
        # directly (no bool mask first): prefix columns 0, each request's new-token block the
        # cached causal block or its tree mask, everything else -inf.
        mask = torch.full((b, 1, lq, lk), float("-inf"), dtype=self.sdpa_dtype, device=dev)
        for i, (q, s) in enumerate(zip(q_lens, kv_slots, strict=True)):
            n = int(s.numel())
            pre = n - q
            mask[i, 0, :q, :pre] = 0.0
            tm = tree_masks[i] if tree_masks is not None else None
            if tm is None:
                mask[i, 0, :q, pre:n] = self._causal(q)
            else:
                mask[i, 0, :q, pre:n].masked_fill_(tm, 0.0)
            if q < lq:  # padded query rows attend to one key so softmax stays finite
                mask[i, 0, q:, 0] = 0.0
        return kv_index, q_index, mask, False  # mask (B, 1, Lq, Lk)

    def plan_run(self, lo: int, lk: int, lq: int, tree_mask: torch.Tensor | None) -> None:
        """:meth:`plan` for one request whose ``lk`` slots are the pool's run [lo, lo + lk)
        (``KVPool.run``), its ``lq`` new tokens the last of them: attend to a view of the pool,
        no gather at all, and write the new tokens' K/V through a view too (a strided copy:
        ~1.5 µs per layer less than index_copy_ at T=1). Every layer's views are made once
        here, per forward; no slot tensor is read or made."""
        self.q_shape = (1, lq)
        self.groups = None
        self.write_slots = self._no_slots  # the run views below are where the tokens go
        self.span_k, self.span_v = _span(self.k_pool, lo, lk), _span(self.v_pool, lo, lk)
        w0 = lo + lk - lq
        self.run_k = self.k_pool[:, w0 : w0 + lq]
        self.run_v = self.v_pool[:, w0 : w0 + lq]
        self.q_index = None
        if tree_mask is None and lq == 1:
            self.mask, self.is_causal = None, False
            return
        self.mask, self.is_causal = self._one_mask(lq, lk, tree_mask)

    def _one_mask(self, lq: int, lk: int, tree_mask: torch.Tensor | None,
                  ) -> tuple[torch.Tensor | None, bool]:
        """One request's (mask, is_causal): no mask for a fresh causal prefill (is_causal),
        else additive (0 / -inf, what SDPA makes of a bool mask on every call, so
        bit-identical): its prefix columns 0, then its own block (the cached causal block or
        its tree mask)."""
        if tree_mask is None and lq == lk:
            return None, True
        if tree_mask is None and lq <= WIDE_CAUSAL_ROWS:  # a draft extend's few rows: a view
            return self._wide_causal(lq, lk)[..., -lk:], False
        block = self._causal(lq) if tree_mask is None else \
            torch.where(tree_mask, 0.0, float("-inf"))
        if block.dtype != self.sdpa_dtype:
            block = block.to(self.sdpa_dtype)
        return torch.cat([block.new_zeros(lq, lk - lq), block], 1).view(1, 1, lq, lk), False

    def _wide_causal(self, q: int, lk: int) -> torch.Tensor:
        """(1, 1, q, W ≥ lk) additive: zeros, then the causal (q, q) block in the last q columns;
        its last lk columns are the mask of q new tokens after lk − q cached ones, a view (SDPA
        gives the same bits as for the contiguous mask: tests/attention/test_paged_plan.py).
        One per q ≤ WIDE_CAUSAL_ROWS, widened (doubling) as contexts grow."""
        w = self._wide.get(q)
        if w is None or w.shape[-1] < lk:
            width = max(256, 1 << (lk - 1).bit_length())
            w = torch.zeros(1, 1, q, width, dtype=self.sdpa_dtype, device=self.device)
            w[0, 0, :, width - q :] = self._causal(q)
            self._wide[q] = w
        return w

    def _causal(self, q: int) -> torch.Tensor:
        """(q, q) additive causal block (0 on and below the diagonal, -inf above); cached for
        the small q of draft extends and short chunks (bounded: at most 64 blocks of ≤ 64²)."""
        t = self._tril.get(q)
        if t is None:
            ones = torch.ones(q, q, dtype=torch.bool, device=self.device)
            t = torch.zeros(q, q, dtype=self.sdpa_dtype, device=self.device)
            t = t.masked_fill_(~ones.tril(), float("-inf"))
            if q <= 64:
                self._tril[q] = t
        return t

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, hd), k/v (T, Hkv, hd) → (T, H, hd) (v's hd when it differs: MLA)."""
        if self.span_k is not None and self.span_v is not None:  # one request, one run of slots
            assert self.run_k is not None and self.run_v is not None
            self.run_k[layer].copy_(k)
            self.run_v[layer].copy_(v)
            return self._sdpa(q, self.span_k[layer], self.span_v[layer], self.q_shape,
                              self.q_index, self.mask, self.is_causal)
        kp, vp = self.k_pool[layer], self.v_pool[layer]
        kp.index_copy_(0, self.write_slots, k)
        vp.index_copy_(0, self.write_slots, v)
        if self.groups is None:
            kk, vv = _gather(kp, vp, self.kv_flat, self.kv_index.shape)
            return self._sdpa(q, kk, vv, self.q_shape, self.q_index, self.mask, self.is_causal)
        out = q.new_empty(q.shape[0], q.shape[1], vp.shape[-1])
        for g in self.groups:
            kk, vv = _gather(kp, vp, g.kv_flat, g.kv_shape)
            out.index_copy_(0, g.rows, self._sdpa(q.index_select(0, g.rows), kk, vv, g.q_shape,
                                                  g.q_index, g.mask, g.is_causal))
        return out

    def _sdpa(self, q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor,
              q_shape: tuple[int, int], q_index: torch.Tensor | None, mask: torch.Tensor | None,
              is_causal: bool) -> torch.Tensor:
        """One SDPA call: q (T, H, hd) laid out as (B, Lq) (``q_index``: where its rows sit
        among padded ones), kk/vv (B, Hkv, Lk, hd) → (T, H, v's hd)."""
        b, lq = q_shape
        if q_index is None:
            qq = q.view(b, lq, *q.shape[1:])
        else:
            qq = q.new_zeros(b * lq, *q.shape[1:]).index_copy_(0, q_index, q)
            qq = qq.view(b, lq, *q.shape[1:])
        dt = qq.dtype
        if dt != self.sdpa_dtype:
            qq, kk, vv = qq.to(self.sdpa_dtype), kk.to(self.sdpa_dtype), vv.to(self.sdpa_dtype)
        o = F.scaled_dot_product_attention(qq.transpose(1, 2), kk, vv, attn_mask=mask,
                                           is_causal=is_causal, enable_gqa=self.gqa)
        o = o.to(dt)
        o = o.transpose(1, 2).reshape(b * lq, q.shape[1], vv.shape[-1])  # MLA: v dim < q dim
        return o if q_index is None else o[q_index]


def _gather(kp: torch.Tensor, vp: torch.Tensor, kv_flat: torch.Tensor,
            kv_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values of ``kv_flat`` (the (B, Lk) slots, flattened) as
    (B, Hkv, Lk, hd) each; index_select: a row memcpy gather, ~2× faster than advanced
    indexing here."""
    shape = (*kv_shape, *kp.shape[1:])
    kk = kp.index_select(0, kv_flat).view(shape).transpose(1, 2)
    vv = vp.index_select(0, kv_flat).view(*shape[:-1], vp.shape[-1]).transpose(1, 2)
    return kk, vv


def _span(pool: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """``pool[:, lo:lo + n].unsqueeze(1).transpose(2, 3)`` — every layer's (1, Hkv, n, hd)
    keys of slots [lo, lo + n) — as one strided view (one op instead of three)."""
    if not pool.is_contiguous():
        return pool[:, lo : lo + n].unsqueeze(1).transpose(2, 3)
    layers, _, hkv, hd = pool.shape
    st = pool.stride()
    return pool.as_strided((layers, 1, hkv, n, hd), (st[0], n * st[1], st[2], st[1], st[3]),
                           pool.storage_offset() + lo * st[1])
