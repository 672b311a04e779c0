"""Overlap scheduling on CUDA: build step N+1's host metadata while the GPU runs step N.

A decode step's host work — slot lists, index tensors, the attention plan — does not depend on
the tokens step N is computing (positions advance by one; the new input token can stay on the
device), so it can run while the GPU is busy instead of after it. Two pieces:

* :class:`Overlap` stages host→device metadata copies without blocking the host: each source is
  packed into a pinned buffer, a side stream waits for the work already queued on the compute
  stream (a replaying graph may still read the destination buffers), issues the async copies
  and records an event; the compute stream waits on that event before its next kernel.
  ``EngineConfig.overlap_schedule`` turns it on for the engine's CUDA-graph runner.
* :func:`run_pipelined` is the one-step-lookahead loop: ``launch(N)``, then ``prepare(N+1)``
  while N runs, then ``finish(N)`` (the only host↔device sync). ``scripts/gpu_check.py``
  measures decode step time with it on and off. The engine's own step is still synchronous
  (sampling and stop checks of step N decide step N+1's batch); pipelining it end to end is
  the next step and needs a one-step-behind output path (SGLang's overlap scheduler).

On CPU both are a no-op by construction: :class:`Overlap` is disabled (plain in-order copies)
and :func:`run_pipelined` runs prepare → launch → finish serially, so results are identical
whether the flag is set or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

P = TypeVar("P")
R = TypeVar("R")

_ALIGN = 64  # bytes: every packed source starts on a 64-byte boundary (any dtype's alignment)


def pack(srcs: list[torch.Tensor], slab: torch.Tensor) -> list[torch.Tensor]:
    """Copy every source into ``slab`` (a 1-D uint8 host buffer) at aligned offsets and return
    the packed views (same dtype and shape as each source). Raises if the slab is too small."""
    views, off = [], 0
    for src in srcs:
        n = src.numel() * src.element_size()
        if off + n > slab.numel():
            raise ValueError(f"pack: slab of {slab.numel()} bytes is too small")
        view = slab[off : off + n].view(src.dtype).view(src.shape)
        view.copy_(src)
        views.append(view)
        off += -(-n // _ALIGN) * _ALIGN
    return views


def packed_bytes(srcs: list[torch.Tensor]) -> int:
    return sum(-(-(s.numel() * s.element_size()) // _ALIGN) * _ALIGN for s in srcs)


class Overlap:
    """Asynchronous metadata staging on a side CUDA stream (disabled on CPU: plain copies)."""

    def __init__(self, device: torch.device | str, enabled: bool, slab_bytes: int = 1 << 20
                 ) -> None:
        self.device = torch.device(device)
        self.enabled = bool(enabled) and self.device.type == "cuda"
        self.copies = 0  # staged batches (for tests and reports)
        if not self.enabled:
            return
        self.stream = torch.cuda.Stream(self.device)
        # Two pinned slabs used in turn: a slab is refilled only after its last copy finished.
        self._slabs = [torch.empty(slab_bytes, dtype=torch.uint8, device="cpu", pin_memory=True)
                       for _ in range(2)]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def stage(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for every (dst on the device, src on the host) pair, in order.

        Enabled: the host packs sources into a pinned slab and returns at once; the copies run
        on the side stream after everything already queued on the compute stream, and the
        compute stream waits for them before its next kernel."""
        self.copies += 1
        if not self.enabled:
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            return
        i = self._turn
        self._turn ^= 1
        done = self._done[i]
        if done is not None:
            done.synchronize()  # usually long finished: the slab was used two stagings ago
        need = packed_bytes([s for _, s in copies])
        if need > self._slabs[i].numel():
            self._slabs[i] = torch.empty(max(need, 2 * self._slabs[i].numel()),
                                         dtype=torch.uint8, device="cpu", pin_memory=True)
        views = pack([s.to("cpu") for _, s in copies], self._slabs[i])
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for (dst, _), view in zip(copies, views, strict=True):
                dst.copy_(view, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)
        self._done[i] = event


class Pipeline(Generic[P, R]):
    """The three phases of one pipelined step (see :func:`run_pipelined`)."""

    def __init__(self, prepare: Callable[[int], P], launch: Callable[[P], R],
                 finish: Callable[[int, R], None]) -> None:
        self.prepare, self.launch, self.finish = prepare, launch, finish


def run_pipelined(steps: int, pipe: Pipeline[P, R], overlap: bool) -> None:
    """Run ``steps`` steps. ``prepare(i)`` builds step i's host metadata (it must not depend on
    ``finish(i-1)``), ``launch(p)`` enqueues the device work and returns its handles without
    syncing, ``finish(i, r)`` consumes them (syncs).

    overlap=False: prepare(i) → launch → finish(i), serially.
    overlap=True: prepare(i+1) runs between launch(i) and finish(i), hiding the host work of
    step i+1 behind the device work of step i. Same calls, same results; only the order of
    prepare(i+1) and finish(i) differs."""
    if steps <= 0:
        return
    if not overlap:
        for i in range(steps):
            pipe.finish(i, pipe.launch(pipe.prepare(i)))
        return
    nxt = pipe.prepare(0)
    for i in range(steps):
        handle = pipe.launch(nxt)
        if i + 1 < steps:
            nxt = pipe.prepare(i + 1)
        pipe.finish(i, handle)
