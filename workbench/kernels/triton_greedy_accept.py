# mypy: allow-untyped-defs
# (@triton.jit parameters stay unannotated: Triton gives annotations a meaning of its own.)
"""Greedy tree acceptance: Triton kernel and its checked host wrapper.

Specification: ``workbench.kernels.reference.greedy_accept``.

One program per request walks the tree in a single pass over node indices (a child always has a
larger index than its parent, so the first matching child of the current node is met first).
Memory traffic per program: read 3*N int64, write N+2 int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels.checks import check_greedy_accept_args


@triton.jit
def _greedy_accept_kernel(
    cand_ptr, parents_ptr, predict_ptr,
    accept_index_ptr, accept_len_ptr, bonus_ptr,
    n_nodes,
    stride_cb, stride_pb, stride_tb, stride_ab,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    path = tl.where(offs == 0, 0, -1).to(tl.int64)  # accept_index row, built in registers
    cur = b * 0  # int64 scalar: the current (last accepted) node
    depth = b * 0  # int64 scalar: accepted non-root nodes
    want = tl.load(predict_ptr + b * stride_tb)  # target argmax at the current node
    for c in range(1, n_nodes):
        parent = tl.load(parents_ptr + b * stride_pb + c)
        token = tl.load(cand_ptr + b * stride_cb + c)
        hit = (parent == cur) & (token == want)
        cur = tl.where(hit, c, cur)
        depth = depth + hit.to(tl.int64)
        path = tl.where(hit & (offs == depth), c, path)
        want = tl.load(predict_ptr + b * stride_tb + cur)
    tl.store(accept_index_ptr + b * stride_ab + offs, path, mask=offs < n_nodes)
    tl.store(accept_len_ptr + b, depth)
    tl.store(bonus_ptr + b, want)


def greedy_accept_triton(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton ``greedy_accept``; arguments and results as ``reference.greedy_accept``.

    Shapes, dtypes and devices are checked; tree invariants are not (no value reads).

    Args:
        candidates: Shape: (B, N), int64.
        parents: Shape: (B, N), int64.
        target_predict: Shape: (B, N), int64.

    Returns:
        accept_index (B, N) int64, accept_len (B,) int64, bonus (B,) int64.
    """
    batch, nodes = check_greedy_accept_args(candidates, parents, target_predict)
    candidates, parents, target_predict = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (candidates, parents, target_predict)
    )
    device = candidates.device
    accept_index = torch.empty((batch, nodes), dtype=torch.int64, device=device)
    accept_len = torch.empty(batch, dtype=torch.int64, device=device)
    bonus = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return accept_index, accept_len, bonus
    _greedy_accept_kernel[(batch,)](
        candidates, parents, target_predict,
        accept_index, accept_len, bonus,
        nodes,
        candidates.stride(0), parents.stride(0), target_predict.stride(0), accept_index.stride(0),
        BLOCK_N=max(16, triton.next_power_of_2(nodes)),
    )
    return accept_index, accept_len, bonus
