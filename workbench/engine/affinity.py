"""Which cores an engine on fewer threads than cores runs on: the ones others leave free.

Fewer threads than cores only help if they run where nobody else does. Left to the kernel's
scheduler, a one-thread engine beside a CPU-bound process pinned to core 1 of a 2-core machine
keeps migrating onto the busy core (measured, 2-core EPYC family 26, idle otherwise: baseline
bs=1 108 tok/s beside the competitor vs 183 alone at one thread; pinned to the other core,
181). So when the contention monitor (or the init stage) settles on ``n`` threads under
contention, every thread of the process is pinned to the ``n`` home cores other processes used
least over a short look (:func:`quiet_cpus`, taken while this engine is between steps, or
:func:`quiet_from` over the window the monitor already watched, when that can tell); with all
cores again, or a quiet machine, the home set comes back. Affinity never changes results (which
core runs a thread, not what it computes).

Linux only (``/proc/stat`` per-CPU lines, ``sched_setaffinity``): elsewhere every function is a
no-op that says so by returning None.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping, Sequence

# the CPUs this process may use, as it started (a user's taskset included): "all cores"
HOME: frozenset[int] | None = (frozenset(os.sched_getaffinity(0))
                               if hasattr(os, "sched_getaffinity") else None)
LOOK_S = 0.12  # long enough for /proc/stat's 10 ms ticks to tell a busy core from an idle one


def stat_lines() -> list[list[str]] | None:
    """``/proc/stat``'s cpu lines, split: the all-CPU line first, then ``cpuN`` ones; None off
    Linux (the one reader of the file: contention.cpu_sample and per_cpu_busy share it)."""
    try:
        with open("/proc/stat") as f:
            lines = [ln.split() for ln in f if ln.startswith("cpu")]
    except OSError:
        return None
    return lines if lines and lines[0][0] == "cpu" else None


def counters(line: list[str]) -> tuple[int, int, int]:
    """(busy, steal, total) ticks of one split ``/proc/stat`` cpu line."""
    v = [int(x) for x in line[1:9]]
    v += [0] * (8 - len(v))
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    busy = user + nice + system + irq + softirq  # guest time is inside user
    return busy, steal, busy + idle + iowait + steal


def per_cpu(lines: list[list[str]]) -> dict[int, int]:
    """Busy ticks of each CPU, from :func:`stat_lines`."""
    return {int(ln[0][3:]): counters(ln)[0] for ln in lines[1:] if ln[0][3:].isdigit()}


def per_cpu_busy() -> dict[int, int] | None:
    """Cumulative busy ticks of each CPU (``/proc/stat`` ``cpuN`` lines); None off Linux."""
    lines = stat_lines()
    return None if lines is None else per_cpu(lines)


def quiet_cpus(window_s: float = LOOK_S) -> list[int] | None:
    """The home CPUs, least busy first over a ``window_s`` look (ties by number); None where
    it cannot be measured. Call it while this process is idle: the look sees the others."""
    if HOME is None:
        return None
    a = per_cpu_busy()
    time.sleep(window_s)
    b = per_cpu_busy()
    if a is None or b is None or not HOME <= a.keys() or not HOME <= b.keys():
        return None
    return sorted(HOME, key=lambda c: (b[c] - a[c], c))


def quiet_from(a: Mapping[int, float] | None, b: Mapping[int, float] | None, wall: float,
               own_s: float, ours: Sequence[int] | None, margin: float) -> list[int] | None:
    """:func:`quiet_cpus`'s order from a window the caller already has, with no look of its
    own (the look sleeps ``LOOK_S`` inside the engine's time). ``a``/``b``: each CPU's busy
    seconds at the window's ends; ``own_s``: this process's CPU seconds in it, taken as spread
    evenly over ``ours`` (the CPUs its threads could run on; None: all home CPUs). Others' use
    of each CPU is its busy time less that share. None — take the look — where the window
    cannot tell: under 10 ticks, a CPU unread, or two CPUs in the order within ``margin``
    cores of each other while not both quiet (under ``margin``): our threads are not exactly
    even, so a close call is the estimate's noise."""
    if HOME is None or a is None or b is None or wall < 0.1:
        return None
    if not HOME <= a.keys() or not HOME <= b.keys():
        return None
    mine = HOME if ours is None else HOME & set(ours)
    if not mine:
        return None
    share = own_s / len(mine)
    use = {c: max(0.0, (b[c] - a[c] - (share if c in mine else 0.0)) / wall) for c in HOME}
    order = sorted(HOME, key=lambda c: (use[c], c))
    for x, y in itertools.pairwise(order):
        if use[y] - use[x] < margin and use[y] >= margin:
            return None
    return order


def pin(n: int, order: Sequence[int] | None) -> list[int] | None:
    """Run every thread of this process on the first ``n`` CPUs of ``order``, or on all home
    CPUs when ``order`` is None or ``n`` covers them. Returns the CPUs pinned to, None when
    the home set is in force (or affinity is not available here)."""
    if HOME is None:
        return None
    if n < 1:
        raise ValueError(f"pin: n must be >= 1, got {n!r}")
    target = HOME if order is None or n >= len(HOME) else frozenset(order[:n])
    if not target <= HOME:
        raise ValueError(f"pin: CPUs {sorted(target - HOME)} are not this process's "
                         f"({sorted(HOME)})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), target)
        except ProcessLookupError:  # the thread ended since the listing: nothing to pin
            continue
    return None if target == HOME else sorted(target)


def crowded(a: Mapping[int, float] | None, b: Mapping[int, float] | None, wall: float,
            cpus: Sequence[int] | None, threshold: float, others_s: float) -> bool:
    """Pinned to ``cpus`` (fewer than all): over a window of ``wall`` s between per-CPU busy
    seconds ``a`` and ``b``, in which other processes used ``others_s`` CPU seconds, did they use
    ``threshold`` cores or more *on ours* while another home CPU stayed at least half idle?
    Every busy tick on a home CPU outside ``cpus`` is someone else's (no thread of ours may run
    there), so others' use on ours is all of theirs less those. Then the pin is stale (the
    neighbour moved onto our core, e.g. when another left the free one) and re-placing the
    threads wins a core back. False where it cannot tell (unpinned, a window under 10 ticks)."""
    if cpus is None or a is None or b is None or HOME is None or wall < 0.1:
        return False
    elsewhere = [(b[c] - a[c]) / wall for c in HOME - set(cpus) if c in a and c in b]
    return others_s / wall - sum(elsewhere) >= threshold and any(u <= 0.5 for u in elsewhere)


def current() -> list[int] | None:
    """The calling thread's CPUs when they are not the home set (None: home, or unknown)."""
    if HOME is None:
        return None
    now = frozenset(os.sched_getaffinity(0))
    return None if now == HOME else sorted(now)
