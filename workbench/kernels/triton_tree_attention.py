# mypy: allow-untyped-defs
# (@triton.jit parameters stay unannotated: Triton gives annotations a meaning of its own.)
"""Tree attention over a paged KV pool: Triton kernel and its checked host wrapper.

Specification: ``workbench.kernels.reference.tree_attention``.

One program handles one request b, one kv head and a block of BLOCK_M of that request's queries
for all ``GROUP = H // Hkv`` query heads sharing the kv head: its tile has
``ROWS = BLOCK_M * GROUP_PAD`` rows (query-major, head-minor), so each K/V block is read once per
group instead of once per query head. It streams the request's kv slots in blocks of BLOCK_N
with an online softmax (FlashAttention-2 style) in fp32.

Memory traffic per program: read ROWS*hd of q, kv_len*hd of K and of V (gathered by slot id),
ROWS*kv_len mask bytes (tree mode only); write ROWS*hd of o.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels.checks import check_tree_attention_args

LOG2E = 1.4426950408889634


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    qo_indptr_ptr, kv_indices_ptr, kv_lens_ptr, mask_ptr,
    qk_scale,  # sm_scale * log2(e): scores go through exp2
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_ib,
    stride_mb, stride_mq,
    lk_max, head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
):
    q_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)

    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    if q_block * BLOCK_M >= q_len:
        return
    kv_len = tl.minimum(tl.load(kv_lens_ptr + b), lk_max)

    # Tile row r = query q_block*BLOCK_M + r // GROUP_PAD, head-in-group r % GROUP_PAD.
    r = tl.arange(0, ROWS)
    qi = q_block * BLOCK_M + r // GROUP_PAD
    g = r % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (qi < q_len) & (g < GROUP)
    d = tl.arange(0, HEAD_DIM)
    d_ok = d < head_dim

    q_rows = q_start + qi  # int64
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Causal-at-the-end: query qi sees kv positions j <= kv_len - q_len + qi.
    last_visible = kv_len - q_len + qi
    if HAS_MASK:
        hi = kv_len
    else:
        hi = tl.minimum(kv_len, kv_len - q_len + (q_block + 1) * BLOCK_M)

    m_i = tl.full([ROWS], -1.0e30, tl.float32)  # finite: an all-masked block yields p = 0
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for start in range(0, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        slot = tl.load(kv_indices_ptr + b * stride_ib + j, mask=j_ok, other=0)
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + slot[:, None] * stride_ks + d[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # (ROWS, BLOCK_N), log2 units
        if HAS_MASK:
            m_off = b * stride_mb + qi[:, None].to(tl.int64) * stride_mq + j[None, :]
            allowed = tl.load(mask_ptr + m_off, mask=row_ok[:, None] & j_ok[None, :], other=0)
            allowed = (allowed != 0) & j_ok[None, :]
        else:
            allowed = (j[None, :] <= last_visible[:, None]) & j_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + slot[:, None] * stride_vs + d[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no visible key: acc = 0 → o = 0
    tl.store(o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _launch_config(group: int, max_q_len: int, head_dim: int) -> tuple[int, int, int, int]:
    """(GROUP_PAD, BLOCK_M, ROWS, HEAD_DIM): tiles of >= 16 rows (tl.dot's minimum), ~64 rows."""
    group_pad = triton.next_power_of_2(group)
    block_m = min(triton.next_power_of_2(max(max_q_len, 1)), max(1, 64 // group_pad))
    block_m = max(block_m, 16 // group_pad, 1)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    return group_pad, block_m, block_m * group_pad, head_dim_pad


def tree_attention_triton(
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
    """Triton ``tree_attention``; arguments and result as ``reference.tree_attention``.

    Only shapes, dtypes and devices are checked (no value reads, no sync) — except that with
    ``mask=None`` and no ``max_q_len`` the longest query run is read from ``qo_indptr`` to size
    the grid. Pass ``max_q_len`` (an upper bound on any request's query count) to avoid that.

    Args:
        q: Shape: (T, H, hd); last dim contiguous.
        k_cache: Shape: (S, Hkv, hd); last dim contiguous.
        v_cache: Shape: (S, Hkv, hd); last dim contiguous.
        qo_indptr: Shape: (B+1,), int64.
        kv_indices: Shape: (B, Lk_max), int64.
        kv_lens: Shape: (B,), int64.
        mask: Shape: (B, Lq_max, Lk_max), bool, or None (causal-at-the-end).
        sm_scale: softmax scale.
        max_q_len: grid-sizing hint when ``mask`` is None.

    Returns:
        o: Shape: (T, H, hd), dtype of q.
    """
    dims = check_tree_attention_args(q, k_cache, v_cache, qo_indptr, kv_indices, kv_lens, mask,
                                     sm_scale)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), "
                             f"got strides {x.stride()}")
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    if dims.tokens == 0:
        return o
    kv_indices = kv_indices if kv_indices.stride(-1) == 1 else kv_indices.contiguous()
    if mask is not None:
        lq = dims.lq_max if dims.lq_max is not None else 0
        mask_u8 = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)
        stride_mb, stride_mq = mask_u8.stride(0), mask_u8.stride(1)
    else:
        if max_q_len is None:
            max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
        lq = max_q_len
        mask_u8 = kv_indices  # never read when HAS_MASK is False
        stride_mb, stride_mq = 0, 0
    group = dims.heads // dims.kv_heads
    group_pad, block_m, rows, head_dim_pad = _launch_config(group, lq, dims.head_dim)
    grid = (triton.cdiv(max(lq, 1), block_m), dims.batch, dims.kv_heads)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, o,
        qo_indptr, kv_indices, kv_lens, mask_u8,
        float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        o.stride(0), o.stride(1),
        kv_indices.stride(0),
        stride_mb, stride_mq,
        dims.lk_max, dims.head_dim,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, ROWS=rows,
        BLOCK_N=64, HEAD_DIM=head_dim_pad, HAS_MASK=mask is not None,
        IEEE=q.dtype == torch.float32,
    )
    return o
