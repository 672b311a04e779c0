"""Choose and build the attention backend named by ``EngineConfig.attention_backend``.

All three share PagedAttention's plan/run interface:

* ``torch`` — :class:`~workbench.engine.attention.PagedAttention` (SDPA over a gather; CPU path);
* ``triton`` — :class:`~workbench.engine.triton_backend.TritonTreeAttention` (CUDA, or CPU under
  ``TRITON_INTERPRET=1`` for tests);
* ``flashinfer`` — :class:`~workbench.engine.flashinfer_backend.FlashInferAttention` (CUDA only).

``auto``: flashinfer on CUDA when it imports, else triton on CUDA when installed, else torch.
A backend that cannot be built raises; the engine turns that into
``EngineInitError(stage="attention_backend")`` (or ``draft_attention_backend``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

BACKENDS = ("auto", "torch", "triton", "flashinfer")


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
                           num_heads: int, page_size: int) -> Any:
    """Build the backend for one pool (k/v: (L, S, Hkv, hd))."""
    name = resolve_backend(kind, k_pool.device)
    if name == "torch":
        from workbench.engine.attention import PagedAttention

        return PagedAttention(k_pool, v_pool, num_heads)
    if name == "triton":
        from workbench.engine.triton_backend import TritonTreeAttention

        return TritonTreeAttention(k_pool, v_pool, num_heads)
    from workbench.engine.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(k_pool, v_pool, num_heads, page_size)


def backend_name(backend: object) -> str:
    """``torch`` / ``triton`` / ``flashinfer`` for a built backend (for events and reports)."""
    return {"PagedAttention": "torch", "TritonTreeAttention": "triton",
            "FlashInferAttention": "flashinfer"}.get(type(backend).__name__,
                                                     type(backend).__name__)
