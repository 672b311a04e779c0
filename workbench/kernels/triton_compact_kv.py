# mypy: allow-untyped-defs
# (@triton.jit parameters stay unannotated: Triton gives annotations a meaning of its own.)
"""KV compaction (``pool[:, dst] = pool[:, src]`` for K and V): Triton kernel and host wrapper.

Specification: ``workbench.kernels.reference.compact_kv``.

Gather-before-scatter across the whole grid cannot be ordered inside one launch (programs do not
synchronise), so the wrapper launches one row-copy kernel twice: gather the M source rows of
every layer into a scratch buffer, then scatter them to their destinations. Kernel boundaries
order the phases. Each program copies a (BLOCK_R rows x BLOCK_C elements) tile of K and of V.

Memory traffic: read 2*L*M*Hkv*hd elements twice and write them twice (the scratch round trip);
M is an accepted path's length per request, so this is small next to one attention layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels.checks import check_compact_kv_args


@triton.jit
def _copy_rows_kernel(
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr,
    src_rows_ptr, dst_rows_ptr,
    n_rows, row_elems,
    src_stride_l, src_stride_s, dst_stride_l, dst_stride_s,
    SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    layer = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    i_ok = i < n_rows
    ok = i_ok[:, None] & (col < row_elems)[None, :]
    # Row i reads src row src_rows[i] (or i) and writes dst row dst_rows[i] (or i).
    if SRC_INDEXED:
        src_row = tl.load(src_rows_ptr + i, mask=i_ok, other=0)
    else:
        src_row = i.to(tl.int64)
    if DST_INDEXED:
        dst_row = tl.load(dst_rows_ptr + i, mask=i_ok, other=0)
    else:
        dst_row = i.to(tl.int64)
    src_off = layer * src_stride_l + src_row[:, None] * src_stride_s + col[None, :]
    dst_off = layer * dst_stride_l + dst_row[:, None] * dst_stride_s + col[None, :]
    k = tl.load(src_k_ptr + src_off, mask=ok)
    v = tl.load(src_v_ptr + src_off, mask=ok)
    tl.store(dst_k_ptr + dst_off, k, mask=ok)
    tl.store(dst_v_ptr + dst_off, v, mask=ok)


def _launch_copy(
    src: tuple[torch.Tensor, torch.Tensor],
    dst: tuple[torch.Tensor, torch.Tensor],
    src_rows: torch.Tensor | None,
    dst_rows: torch.Tensor | None,
    n_rows: int,
    row_elems: int,
) -> None:
    """Copy rows between (L, rows, row_elems)-strided K/V buffers; None rows = identity."""
    layers = src[0].shape[0]
    block_c = max(16, min(triton.next_power_of_2(row_elems), 1024))
    block_r = max(2, min(triton.next_power_of_2(n_rows), 4096 // block_c))
    index = src_rows if src_rows is not None else dst_rows
    assert index is not None
    grid = (triton.cdiv(n_rows, block_r), layers, triton.cdiv(row_elems, block_c))
    _copy_rows_kernel[grid](
        src[0], src[1], dst[0], dst[1],
        src_rows if src_rows is not None else index,
        dst_rows if dst_rows is not None else index,
        n_rows, row_elems,
        src[0].stride(0), src[0].stride(1), dst[0].stride(0), dst[0].stride(1),
        SRC_INDEXED=src_rows is not None, DST_INDEXED=dst_rows is not None,
        BLOCK_R=block_r, BLOCK_C=block_c,
    )


def compact_kv_triton(
    k_pool: torch.Tensor, v_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Triton ``compact_kv``; arguments as ``reference.compact_kv`` (in place, returns None).

    Shapes, dtypes and devices are checked; slot ranges and distinct destinations are not.

    Args:
        k_pool: Shape: (L, S, Hkv, hd); each slot's (Hkv, hd) block contiguous.
        v_pool: Shape: (L, S, Hkv, hd), same strides as k_pool.
        src_slots: Shape: (M,), int64.
        dst_slots: Shape: (M,), int64.
    """
    layers, _, n_rows = check_compact_kv_args(k_pool, v_pool, src_slots, dst_slots)
    _, _, kv_heads, head_dim = k_pool.shape
    row_elems = kv_heads * head_dim
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.stride(3) != 1 or pool.stride(2) != head_dim:
            raise ValueError(f"{name} must have each slot's (Hkv, hd) block contiguous, "
                             f"got strides {pool.stride()}")
    if v_pool.stride() != k_pool.stride():
        raise ValueError(f"v_pool strides {v_pool.stride()} differ from k_pool's {k_pool.stride()}")
    if n_rows == 0 or layers == 0 or row_elems == 0:
        return
    src_slots, dst_slots = src_slots.contiguous(), dst_slots.contiguous()
    # (L, M, Hkv*hd) scratch rows for K and V.
    scratch = torch.empty((2, layers, n_rows, row_elems), dtype=k_pool.dtype,
                          device=k_pool.device)
    pools = (k_pool, v_pool)
    bufs = (scratch[0], scratch[1])
    _launch_copy(pools, bufs, src_slots, None, n_rows, row_elems)  # gather
    _launch_copy(bufs, pools, None, dst_slots, n_rows, row_elems)  # scatter
