"""Allocation tracking for reliability checks: what is alive, how many bytes, how much RSS.

A failed ``Engine`` init must leave nothing behind (DESIGN.md §5), and a long soak must not grow.
Both are checked by comparing two :class:`Snapshot`\\ s taken with :func:`snapshot`:

    before = snapshot()
    ...  # build an engine that fails, or serve 10,000 requests
    leaks = snapshot().grown_since(before)   # {} when nothing survived

Counts come from the garbage collector's view (``gc.get_objects()``) after a full collection, so
they see objects held anywhere — in a traceback, a closure or a forgotten list — not just the ones
a test kept a name for. Cost: one full collection plus one pass over every tracked object (tens of
milliseconds with torch loaded); use it around a scenario, never inside a step.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

# Engine-owned types whose instances must not outlive a failed or closed engine (by name, so
# this module imports no engine code and counts subclasses too).
TRACKED = ("Engine", "KVPool", "PagedAttention", "Scheduler", "LlamaForCausalLM", "Eagle3Draft")


@dataclass(frozen=True)
class Snapshot:
    """Live instances per tracked type, and bytes held by live CPU/GPU tensor storages."""

    counts: dict[str, int] = field(default_factory=dict)
    tensor_bytes: int = 0
    rss_bytes: int = 0

    def grown_since(self, before: Snapshot, slack_bytes: int = 0) -> dict[str, int]:
        """What this snapshot holds beyond ``before``: {type name: extra instances} plus
        ``"tensor_bytes"`` when live tensor storage grew by more than ``slack_bytes``."""
        grown = {k: n - before.counts.get(k, 0) for k, n in self.counts.items()
                 if n > before.counts.get(k, 0)}
        extra = self.tensor_bytes - before.tensor_bytes
        if extra > slack_bytes:
            grown["tensor_bytes"] = extra
        return grown


def _matcher(names: tuple[str, ...]) -> Callable[[object], tuple[str, ...]]:
    """obj → the names in ``names`` of its class and base classes (cached per class)."""
    cache: dict[type, tuple[str, ...]] = {}

    def match(obj: object) -> tuple[str, ...]:
        t = type(obj)
        hit = cache.get(t)
        if hit is None:
            mro = {c.__name__ for c in t.__mro__}
            hit = cache[t] = tuple(n for n in names if n in mro)
        return hit

    return match


def live(type_name: str) -> list[object]:
    """Every live object whose class (or a base class) is called ``type_name``."""
    gc.collect()
    match = _matcher((type_name,))
    return [o for o in gc.get_objects() if match(o)]


def tensor_bytes(objects: list[object] | None = None) -> int:
    """Bytes of the distinct storages behind every live tensor (views counted once)."""
    seen: set[int] = set()
    total = 0
    for o in gc.get_objects() if objects is None else objects:
        if issubclass(type(o), torch.Tensor):  # type(): never touch a lazy module's __class__
            try:
                st = cast(torch.Tensor, o).untyped_storage()
                key = st.data_ptr()
            except RuntimeError:  # meta / sparse / functional / fake tensors (a torch.compile
                continue  # trace still alive) own no countable storage
            if key and key not in seen:
                seen.add(key)
                total += st.nbytes()
    return total


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


def snapshot() -> Snapshot:
    """Collect garbage, then count tracked instances, tensor bytes and RSS."""
    gc.collect()
    objs = gc.get_objects()
    counts = dict.fromkeys(TRACKED, 0)
    match = _matcher(TRACKED)
    for o in objs:
        for t in match(o):
            counts[t] += 1
    return Snapshot(counts, tensor_bytes(objs), rss_bytes())
