"""Verify-step kernels: tree attention, tree acceptance, KV compaction.

Each kernel has three layers: a ``@triton.jit`` kernel and its checked host wrapper
in ``triton_<name>.py``, and a torch reference in ``reference.py`` that is both the specification
and the CPU fallback. The functions below dispatch:

* CUDA tensors and triton installed → Triton; otherwise → the reference.
* ``WORKBENCH_KERNELS=reference`` forces the reference; ``WORKBENCH_KERNELS=triton`` forces Triton
  (on CPU tensors this needs ``TRITON_INTERPRET=1`` set before triton is first imported).

Importing this package never imports triton: the Triton modules load on first use, so the
reference path works with torch alone.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch

from workbench.kernels import reference

__all__ = [
    "backend_for",
    "compact_kv",
    "greedy_accept",
    "tree_attention",
    "tree_speculative_sample",
    "triton_available",
]

ENV_VAR = "WORKBENCH_KERNELS"
_MODES = ("auto", "reference", "triton")


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def backend_for(device: torch.device) -> str:
    """``"triton"`` or ``"reference"``: the backend a kernel call on ``device`` will use.

    Reads ``WORKBENCH_KERNELS`` (``auto`` when unset) on every call, so tests and notebooks may
    change it at run time.
    """
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(_MODES)}, got {mode!r}")
    if mode == "reference":
        return "reference"
    if mode == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not installed "
                           "(pip install 'workbench[kernels]')")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{ENV_VAR}=triton on {device.type} tensors needs TRITON_INTERPRET=1, "
                           "set before triton is first imported")
    return "triton"


def _triton_module(name: str) -> ModuleType:
    return importlib.import_module(f"workbench.kernels.triton_{name}")


def tree_attention(
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
    """Attention of ragged queries over a paged KV pool with a per-request (tree) mask.

    Shapes: q (T, H, hd); k_cache, v_cache (S, Hkv, hd); qo_indptr (B+1,) int64; kv_indices
    (B, Lk_max) int64; kv_lens (B,) int64; mask (B, Lq_max, Lk_max) bool or None (causal at the
    end) → o (T, H, hd). Full contract: ``reference.tree_attention``.
    """
    if backend_for(q.device) == "triton":
        fn = _triton_module("tree_attention").tree_attention_triton
    else:
        fn = reference.tree_attention
    return fn(q, k_cache, v_cache, qo_indptr, kv_indices, kv_lens, mask, sm_scale,
              max_q_len=max_q_len)


def greedy_accept(
    candidates: torch.Tensor, parents: torch.Tensor, target_predict: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification.

    Shapes: candidates, parents, target_predict (B, N) int64 → accept_index (B, N),
    accept_len (B,), bonus (B,), all int64. Full contract: ``reference.greedy_accept``.
    """
    if backend_for(candidates.device) == "triton":
        fn = _triton_module("greedy_accept").greedy_accept_triton
    elif candidates.device.type == "cpu":
        fn = reference.greedy_accept_walk  # the same walk over Python ints: ~10x fewer µs
    else:
        fn = reference.greedy_accept
    return fn(candidates, parents, target_predict)


def tree_speculative_sample(
    candidates: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless recursive rejection sampling of a draft tree (one-hot drafts).

    Shapes: candidates, parents (B, N) int64; target_probs (B, N, V) float32; coins (B, N)
    float32; final_u (B,) float32 → accept_index (B, N), accept_len (B,), bonus (B,), int64.
    Full contract: ``reference.tree_speculative_sample``.
    """
    if backend_for(candidates.device) == "triton":
        fn = _triton_module("tree_sample").tree_speculative_sample_triton
    else:
        fn = reference.tree_speculative_sample
    return fn(candidates, parents, target_probs, coins, final_u)


def compact_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
    host: tuple[list[int], list[int]] | None = None
) -> None:
    """In place ``pool[:, dst_slots[i]] = pool[:, src_slots[i]]`` for K and V, gather first.

    Shapes: k_pool, v_pool (L, S, Hkv, hd); src_slots, dst_slots (M,) int64.
    ``host``: the slots as host lists too (the CPU reference checks them there).
    Full contract: ``reference.compact_kv``.
    """
    if backend_for(k_pool.device) == "triton":
        _triton_module("compact_kv").compact_kv_triton(k_pool, v_pool, src_slots, dst_slots)
    else:
        reference.compact_kv(k_pool, v_pool, src_slots, dst_slots, host)
