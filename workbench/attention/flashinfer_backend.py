"""Paged attention through FlashInfer (CUDA only), with PagedAttention's plan/run.

FlashInfer is optional (the ``gpu`` extra) and is imported only when this backend is built, on a
CUDA pool. Its paged cache is (num_pages, page_size, Hkv, hd) per layer ("NHD"); our pool is
(L, S, Hkv, hd) with slot = page·page_size + offset and S = num_pages·page_size, so each layer's
page view is a zero-copy ``view``.

``plan`` (once per forward) derives each request's page list from its kv slots — the engine
passes slots of positions [0, kv_len), so page p is ``slots[p·page_size] // page_size`` — and
plans one wrapper:

* every request decodes one token, no tree → ``BatchDecodeWithPagedKVCacheWrapper``;
* otherwise (prefill chunks, draft extend, tree verify) → ``BatchPrefillWithPagedKVCacheWrapper``
  with ``causal=True`` (bottom-right aligned: query i sees kv j <= kv_len - q_len + i), or with a
  ``custom_mask`` (each request's (q_len, kv_len) block, row-major, concatenated) when any
  request has a tree mask.

``run`` (every layer) scatters the new K/V into the pool, then ``wrapper.run``.

:class:`FlashInferDecodeGraph` is the fixed-batch variant for CUDA graphs (``use_cuda_graph``
wrappers with preallocated index buffers; ``plan_static`` before each replay).
"""

from __future__ import annotations

import torch

from workbench.attention.triton_backend import (
    RaggedPlan,
    Stage,
    block_mask,
    check_plan_args,
    copy_all,
    has_tree,
    pad_rows,
)

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace


def _require_cuda(pool: torch.Tensor, what: str) -> None:
    if pool.device.type != "cuda":
        raise RuntimeError(f"{what} needs a CUDA device, the KV pool is on {pool.device}")


def page_table(kv_slots: list[torch.Tensor], page_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-request slots of positions [0, kv_len) → FlashInfer's paged layout (host, int32):
    indptr (B+1,), indices (Σ pages,), last_page_len (B,) in [1, page_size]."""
    pages, counts, last = [], [], []
    for b, s in enumerate(kv_slots):
        n = int(s.numel())
        first = s[::page_size].to("cpu", torch.int64)  # slot of each page's offset 0
        if bool((first % page_size != 0).any()):
            raise ValueError(f"plan: request {b}'s kv slots are not page-aligned positions "
                             f"[0, kv_len) (page_size {page_size})")
        pages.append(first // page_size)
        counts.append(int(first.numel()))
        last.append((n - 1) % page_size + 1)
    indptr = torch.zeros(len(kv_slots) + 1, dtype=torch.int32, device="cpu")
    indptr[1:] = torch.tensor(counts, device="cpu").cumsum(0)
    last_len = torch.tensor(last, dtype=torch.int32, device="cpu")
    return indptr, torch.cat(pages).to(torch.int32), last_len


def flat_custom_mask(q_lens: list[int], kv_lens: list[int],
                     tree_masks: list[torch.Tensor | None] | None) -> torch.Tensor:
    """FlashInfer's custom_mask: every request's (q_len, kv_len) block, row-major, concatenated
    (Σ q_b·kv_b,) bool. Requests without a tree mask get the causal block."""
    full = block_mask(q_lens, kv_lens, tree_masks, max(q_lens), max(kv_lens))
    return torch.cat([full[b, :q, :n].reshape(-1)
                      for b, (q, n) in enumerate(zip(q_lens, kv_lens, strict=True))])


class FlashInferAttention:
    """Backend for one pool on FlashInfer's paged kernels (eager: re-planned every forward).

    ``use_tensor_cores`` (default True) runs decode on the prefill kernels: faster for GQA
    groups >= 4 and one JIT module less to compile.
    """

    name = "flashinfer"
    # page tables: kv_slots must be whole positions [0, kv_len) (no draft holes)
    arbitrary_slots = False

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int,
                 page_size: int, *, use_tensor_cores: bool = True, probe: bool = True,
                 workspace: torch.Tensor | None = None) -> None:
        _require_cuda(k_pool, "flashinfer attention backend")
        import flashinfer  # optional dependency: only here, on CUDA

        layers, slots, kv_heads, head_dim = k_pool.shape
        if slots % page_size:
            raise ValueError(f"pool slots {slots} is not a multiple of page_size {page_size}")
        self.k_pool, self.v_pool = k_pool, v_pool  # (L, S, Hkv, hd)
        self.h, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.page_size = page_size
        self.device = k_pool.device
        self.dtype = k_pool.dtype
        self.sm_scale = float(head_dim) ** -0.5
        shape = (layers, slots // page_size, page_size, kv_heads, head_dim)
        self.k_pages, self.v_pages = k_pool.view(shape), v_pool.view(shape)
        # "Must be initialized to 0 for its first use"; shared by both wrappers (one runs per
        # forward, and each forward re-plans).
        self.workspace = workspace if workspace is not None else torch.zeros(
            WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=use_tensor_cores)
        self._wrapper: object = None
        self.write_slots = torch.empty(0, dtype=torch.int64, device=self.device)
        self.mode = ""  # "decode" | "causal" | "tree": what the last plan chose
        if probe:
            self._probe()

    def _probe(self) -> None:
        """Plan and run each kernel once on page 0 (reads only), so an unsupported head dim,
        dtype or GPU fails at the attention_backend init stage, not on the first request."""
        q = torch.zeros(1, self.h, self.head_dim, dtype=self.dtype, device=self.device)
        slots = [torch.zeros(1, dtype=torch.int64, device="cpu")]
        self._plan(slots, [1], None)  # decode
        self._run_kernel(0, q)
        self._plan(slots, [1], None, force_prefill=True)  # causal prefill
        self._run_kernel(0, q)
        self._plan(slots, [1], [torch.ones(1, 1, dtype=torch.bool, device="cpu")])  # custom mask
        self._run_kernel(0, q)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def plan(self, write_slots: torch.Tensor, q_lens: list[int], kv_slots: list[torch.Tensor],
             tree_masks: list[torch.Tensor | None] | None = None) -> None:
        """Same contract as ``PagedAttention.plan``; kv_slots must be the slots of positions
        [0, kv_len) of each request (as ``KVPool.slots(blocks, 0, end)`` returns them)."""
        check_plan_args(write_slots, q_lens, kv_slots, tree_masks)
        self.write_slots = write_slots.to(self.device, torch.int64, non_blocking=True)
        self._plan(kv_slots, q_lens, tree_masks)

    def _plan(self, kv_slots: list[torch.Tensor], q_lens: list[int],
              tree_masks: list[torch.Tensor | None] | None, force_prefill: bool = False) -> None:
        # Host indptr / last_page_len (FlashInfer reads them on the host anyway: no D2H sync),
        # page indices on the device.
        dev = self.device
        indptr, indices, last = page_table(kv_slots, self.page_size)
        indices = indices.to(dev, non_blocking=True)
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.sm_scale)
        tree = has_tree(tree_masks)
        if not tree and not force_prefill and all(q == 1 for q in q_lens):
            self._decode.plan(indptr, indices, last, self.h, self.kv_heads, self.head_dim,
                              self.page_size, pos_encoding_mode="NONE", **common)
            self._wrapper, self.mode = self._decode, "decode"
            return
        qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device="cpu")
        qo_indptr[1:] = torch.tensor(q_lens, device="cpu").cumsum(0)
        if not tree:
            self._prefill.plan(qo_indptr, indptr, indices, last, self.h, self.kv_heads,
                               self.head_dim, self.page_size, causal=True, **common)
            self._wrapper, self.mode = self._prefill, "causal"
            return
        # Custom mask: FlashInfer bit-packs it on the device from offsets it derives from
        # qo_indptr/indptr/last_page_len, so those must be on the mask's device too.
        kv_lens = [int(s.numel()) for s in kv_slots]
        mask = flat_custom_mask(q_lens, kv_lens, tree_masks).to(dev)
        self._prefill.plan(qo_indptr.to(dev), indptr.to(dev), indices, last.to(dev), self.h,
                           self.kv_heads, self.head_dim, self.page_size, custom_mask=mask,
                           causal=False, **common)
        self._wrapper, self.mode = self._prefill, "tree"

    def _run_kernel(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q, (self.k_pages[layer], self.v_pages[layer]))  # type: ignore[attr-defined]

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, hd), k/v (T, Hkv, hd) → (T, H, hd)."""
        self.k_pool[layer].index_copy_(0, self.write_slots, k)
        self.v_pool[layer].index_copy_(0, self.write_slots, v)
        return self._run_kernel(layer, q.contiguous())


class FlashInferDecodeGraph:
    """Fixed-batch FlashInfer decode for one CUDA-graph bucket (q_len 1, ``batch`` rows).

    Buffers at fixed addresses: write_slots, row_src (batch,) int64; the wrapper's indptr
    (batch+1,), indices (batch·max_pages,) and last_page_len (batch,) int32. ``plan_static``
    (outside the graph) pads with copies of request 0 (``pad_rows``) and re-plans the wrapper,
    which rewrites those buffers in place; ``run`` is what the graph captures.
    """

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int,
                 page_size: int, batch: int, max_kv: int, workspace: torch.Tensor) -> None:
        _require_cuda(k_pool, "flashinfer decode graphs")
        import flashinfer

        layers, slots, kv_heads, head_dim = k_pool.shape
        dev = self.device = k_pool.device
        self.k_pool, self.v_pool = k_pool, v_pool
        shape = (layers, slots // page_size, page_size, kv_heads, head_dim)
        self.k_pages, self.v_pages = k_pool.view(shape), v_pool.view(shape)
        self.h, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.page_size, self.dtype = page_size, k_pool.dtype
        self.sm_scale = float(head_dim) ** -0.5
        self.static_shape = (batch, 1, max_kv)
        max_pages = -(-max_kv // page_size)
        self._indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self._indices = torch.zeros(batch * max_pages, dtype=torch.int32, device=dev)
        self._last = torch.ones(batch, dtype=torch.int32, device=dev)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=self._indptr, paged_kv_indices_buffer=self._indices,
            paged_kv_last_page_len_buffer=self._last)
        self.write_slots = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.row_src = torch.arange(batch, dtype=torch.int64, device=dev)
        self.pin = False  # GraphRunner sets it with overlap: plan from pinned host tensors

    def plan_static(self, p: RaggedPlan, stage: Stage | None = None) -> None:
        """Host plan of ``n_real <= batch`` one-token requests → the fixed buffers (``stage``
        as in ``TritonTreeAttention.plan_static``; the wrapper's own plan copies its index
        buffers on the current stream from host tensors)."""
        batch, _, max_kv = self.static_shape
        b = len(p.q_lens)
        if b > batch or any(q != 1 for q in p.q_lens) or p.mask is not None \
                or int(p.kv_indices.shape[1]) > max_kv:
            raise ValueError(f"plan_static: {b} requests, q_lens {sorted(set(p.q_lens))} do not "
                             f"fit the decode bucket {self.static_shape}")
        rows = pad_rows(b, batch, 1)
        kv = [p.kv_indices[r, : int(p.kv_lens[r])] for r in rows.tolist()]
        (stage or copy_all)([(self.write_slots, p.write_slots[rows]), (self.row_src, rows)])
        indptr, indices, last = page_table(kv, self.page_size)
        if self.pin:  # pageable host→device copies would wait for the replay in flight
            indptr, indices, last = (t.pin_memory() for t in (indptr, indices, last))
        self._wrapper.plan(indptr, indices, last, self.h, self.kv_heads, self.head_dim,
                           self.page_size, pos_encoding_mode="NONE", q_data_type=self.dtype,
                           kv_data_type=self.dtype, sm_scale=self.sm_scale)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (batch, H, hd), k/v (batch, Hkv, hd) → (batch, H, hd). Captured by the graph."""
        self.k_pool[layer].index_copy_(0, self.write_slots, k.index_select(0, self.row_src))
        self.v_pool[layer].index_copy_(0, self.write_slots, v.index_select(0, self.row_src))
        return self._wrapper.run(q.contiguous(), (self.k_pages[layer], self.v_pages[layer]))
