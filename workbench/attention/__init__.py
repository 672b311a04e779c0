"""Attention backends over the paged KV pool: one Protocol, three implementations.

Every backend has the plan/run split and declares its capabilities as class
attributes (no ``getattr`` probing):

* ``torch`` — :class:`~workbench.attention.paged.PagedAttention` (SDPA over a gather; CPU path);
* ``triton`` — :class:`~workbench.attention.triton_backend.TritonTreeAttention` (CUDA, or CPU
  under ``TRITON_INTERPRET=1`` for tests);
* ``flashinfer`` — :class:`~workbench.attention.flashinfer_backend.FlashInferAttention` (CUDA
  only);
* ``invariant`` — :class:`~workbench.attention.invariant.RowInvariantAttention` (CPU: every
  row bit-identical whatever shares its forward; what ``EngineConfig(batch_invariant=True)``
  runs).

``auto``: flashinfer on CUDA when it imports, else triton on CUDA when installed, else torch.
A backend that cannot be built raises; the engine turns that into
``EngineInitError(stage="attention_backend")`` (or ``draft_attention_backend``).

:class:`~workbench.attention.tree_draft.TreeDraftAttention` (the drafter's tree-local attention)
lives here too, so :mod:`workbench.speculative` imports no engine module.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Protocol, runtime_checkable

import torch

BACKENDS = ("auto", "torch", "triton", "flashinfer", "invariant")


@runtime_checkable
class AttentionBackend(Protocol):
    """What the model's layers and the ModelRunner need from a backend for one pool."""

    name: str  # "torch" | "triton" | "flashinfer" | "invariant" (events, reports)
    # Capability: ``plan`` accepts any slot list per request (a draft with holes); False for
    # page-table backends, which need whole positions [0, kv_len).
    arbitrary_slots: bool

    def plan(self, write_slots: torch.Tensor, q_lens: list[int], kv_slots: list[torch.Tensor],
             tree_masks: list[torch.Tensor | None] | None = None) -> None:
        """Once per forward: write_slots (T,) slots of the new tokens in order; q_lens per
        request; kv_slots per request = prefix slots then the new tokens' slots; tree_masks per
        request (q_len, q_len) bool ancestor mask over the new tokens, or None for causal."""

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Every layer: write k/v (T, Hkv, hd) to the planned slots, attend q (T, H, hd)."""


def resolve_backend(kind: str, device: torch.device) -> str:
    """The concrete backend ``kind`` means on ``device``."""
    if kind not in BACKENDS:
        raise ValueError(f"attention_backend: {kind!r} not in {BACKENDS}")
    if kind != "auto":
        return kind
    if device.type == "cuda":
        try:
            importlib.import_module("flashinfer")
            return "flashinfer"
        except (ImportError, OSError, RuntimeError):  # absent or broken install: next choice
            pass
        if importlib.util.find_spec("triton") is not None:
            return "triton"
    return "torch"


def make_attention_backend(kind: str, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           num_heads: int, page_size: int) -> AttentionBackend:
    """Build the backend for one pool (k/v: (L, S, Hkv, hd))."""
    name = resolve_backend(kind, k_pool.device)
    if name == "torch":
        from workbench.attention.paged import PagedAttention

        return PagedAttention(k_pool, v_pool, num_heads)
    if name == "invariant":
        from workbench.attention.invariant import RowInvariantAttention

        return RowInvariantAttention(k_pool, v_pool, num_heads)
    if name == "triton":
        from workbench.attention.triton_backend import TritonTreeAttention

        return TritonTreeAttention(k_pool, v_pool, num_heads)
    from workbench.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(k_pool, v_pool, num_heads, page_size)


def backend_name(backend: AttentionBackend) -> str:
    """``torch`` / ``triton`` / ``flashinfer`` for a built backend (for events and reports)."""
    return backend.name
