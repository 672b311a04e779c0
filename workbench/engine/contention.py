"""Contention: is this process sharing the CPU, and how many threads should it use right now.

On a small CPU a bs=1 decode is a chain of short parallel regions: with two OpenMP threads on
two cores, every GEMM waits at its barrier for the slower thread, and when anything else runs
on one core the step collapses far below a fair share (2-core EPYC, one CPU-bound process
pinned to core 1: baseline 24 tok/s with 2 threads vs 255 with 1, idle 280; docs/PERFORMANCE.md).
So the engine measures what it can see and adapts what it can change:

* :class:`Conditions` — what the machine looked like over a window: the CPU time *other*
  processes used (``/proc/stat`` busy time minus this process's own CPU time, in cores), the
  hypervisor's steal share, the 1-min load average, and the engine's own step-time drift
  against its calibration. :attr:`Conditions.contended` says whether a measurement taken then
  is only provisional (``engine/autotune.py`` never caches one as final);
* :func:`time_threads` (``engine/thread_timing.py``) — the thread counts timed in turns on the
  engine's own prepared GEMMs (a decode M=1 and a verify M=16 pass over the real weights), the
  median of each: under contention the typical step is what a user gets, so medians, not least
  times, decide here; a count that has clearly lost takes no more turns;
* :class:`ContentionMonitor` — watches the engine's step times (per mode, batch bucket, tree
  shape and context bucket, against the best window it has seen) and the machine between
  steps; when the machine turns busy (or quiet again), or the steps drift where the machine's
  counters cannot tell why, it re-times the thread counts and applies the fastest, with a
  growing back-off while the measurement keeps confirming the current choice. A drift on a
  machine the counters see as quiet, at all cores, is the workload's own: re-calibrated.

What it cannot change: the OpenMP wait policy (libgomp reads ``OMP_WAIT_POLICY`` once, when
torch loads), so it is recorded (:func:`omp_wait_policy`) and the thread count is the lever;
the GEMM path is re-measured at the next start (a provisional choice is never cached).
Thread counts do not change results: the GEMMs split rows and columns, never the reduction
(checked bit for bit in tests/engine/test_contention.py and the lossless suites).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from workbench.engine import affinity

# the timing itself (thread_timing.py); gemm_pass is named here for autotune and the engine
from workbench.engine.thread_timing import (
    gemm_pass,  # noqa: F401
    pick_threads,
    thread_candidates,
    time_threads,
)

# others' CPU use (in cores) at or above which a window counts as contended: a third of a core
# is what a background build or a notebook kernel costs; below it timings hold to ~10 %
OTHERS_CORES = 0.35
STEAL_SHARE = 0.05  # hypervisor steal share at or above which a window counts as contended
DRIFT = 1.5  # own step time / calibration at or above which the steps have drifted
WINDOW = 8  # steps per window of the step-time monitor
# the monitor looks at the machine at most this often: a look is one read of /proc/stat (tens of
# µs), and with a neighbour on a core two threads run a GEMM pass ~25x slower (3.5 → 89 ms,
# measured), so every second spent noticing costs more than years of looks
CHECK_S = 0.5
BACKOFF_S = (0.5, 60.0)  # first and longest wait after a measurement confirmed the choice
SPIKE = 3.0  # one step this many times its calibration asks the machine at once (no window)
LOOK_S = 0.15  # the init stage's look at the machine (a window of 15 ticks at 100 Hz)
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# torch's thread count when this module loaded (OMP_NUM_THREADS or all cores): what "all
# cores" means for every engine of the process, whatever another engine adapted it to since
PROCESS_THREADS = torch.get_num_threads()


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU counters at one instant: ``busy``/``steal``/``total`` seconds of all
    CPUs (``/proc/stat``), this process's own CPU seconds, the wall clock, and each CPU's busy
    seconds (``cpus``, by CPU number; None where not read)."""

    wall: float
    busy: float
    steal: float
    total: float
    own: float
    cpus: Mapping[int, float] | None = None


def cpu_sample() -> CpuSample | None:
    """Now's counters; None where ``/proc/stat`` does not exist (not Linux)."""
    lines = affinity.stat_lines()
    if lines is None:
        return None
    busy, steal, total = affinity.counters(lines[0])
    per = {c: t / TICK for c, t in affinity.per_cpu(lines).items()}
    return CpuSample(time.perf_counter(), busy / TICK, steal / TICK, total / TICK,
                     time.process_time(), per)


def others_s(a: CpuSample, b: CpuSample) -> float:
    """CPU seconds other processes used from ``a`` to ``b`` (all busy time less our own)."""
    return max(0.0, (b.busy - a.busy) - (b.own - a.own))


def cores() -> int:
    """The CPUs this process may run on as it started (its affinity mask then: a pin of our
    own to fewer cores does not shrink "all cores"), else ``os.cpu_count()``."""
    if affinity.HOME is not None:
        return len(affinity.HOME)
    return os.cpu_count() or 1


def load1() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


@dataclass(frozen=True)
class Conditions:
    """The machine over one window. ``others``: CPU time other processes used, in cores (None:
    not measurable here); ``steal``: the hypervisor's share of all CPU time; ``load1`` the 1-min
    load average at the end; ``drift`` the engine's own step time over its calibration (None:
    not known). ``cores``: this process's CPUs. ``time``: when the window ended."""

    cores: int
    window_s: float
    others: float | None
    steal: float | None
    load1: float | None
    drift: float | None = None
    time: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))

    def reasons(self) -> list[str]:
        """Why the window counts as contended ([]: quiet)."""
        out = []
        if self.others is not None and self.others >= OTHERS_CORES:
            out.append(f"other processes used {self.others:.2f} of {self.cores} cores")
        if self.steal is not None and self.steal >= STEAL_SHARE:
            out.append(f"steal {100 * self.steal:.0f} %")
        if self.others is None and self.load1 is not None and self.load1 > self.cores:
            # the 1-min average lags by a minute: only a witness where others is not measured
            out.append(f"load {self.load1:.1f} > {self.cores} cores")
        if self.others is None and self.drift is not None and self.drift >= DRIFT:
            # like the load average, only a witness where others is not measured: on a machine
            # where nobody else runs, slower steps are the workload's own (longer contexts,
            # another mix of step kinds), and a quiet run must not read as contended
            out.append(f"steps {self.drift:.1f}x their calibration")
        return out

    @property
    def contended(self) -> bool:
        return bool(self.reasons())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["contended"] = self.contended
        return d

    def describe(self) -> str:
        """``quiet (others 0.05 cores, steal 0 %, load 0.4 on 2 cores)`` or
        ``busy: other processes used 0.93 of 2 cores (steal 0 %, load 1.3 on 2 cores)``."""
        facts = []
        if self.others is not None:
            facts.append(f"others {self.others:.2f} cores")
        if self.steal is not None:
            facts.append(f"steal {100 * self.steal:.0f} %")
        facts.append(f"load {self.load1 if self.load1 is not None else '?'} on {self.cores} "
                     "cores")
        why = self.reasons()
        head = "busy: " + "; ".join(why) if why else "quiet"
        return f"{head} ({', '.join(facts)})"

RESOLVE_S = 0.12  # a look long enough for /proc/stat's 10 ms ticks to resolve others' use


def between(a: CpuSample | None, b: CpuSample | None, drift: float | None = None) -> Conditions:
    """The conditions over the window from sample ``a`` to sample ``b``."""
    n = cores()
    if a is None or b is None or b.wall <= a.wall:
        return Conditions(n, 0.0, None, None, load1(), drift)
    wall = b.wall - a.wall
    total = b.total - a.total
    others = others_s(a, b) / wall
    # /proc/stat counts in ticks: a window of a few ticks cannot tell 0.3 cores from 0
    resolved = wall * TICK >= 10
    return Conditions(n, round(wall, 3), round(min(others, float(n)), 2) if resolved else None,
                      round((b.steal - a.steal) / total, 3) if total > 0 and resolved else None,
                      load1(), drift)


def measure(window_s: float = 0.2) -> Conditions:
    """Sleep ``window_s`` and report what the rest of the machine did meanwhile."""
    a = cpu_sample()
    time.sleep(window_s)
    return between(a, cpu_sample())


def omp_wait_policy() -> str:
    """The OpenMP wait policy in force (fixed when torch loaded): the environment's
    ``OMP_WAIT_POLICY``, or libgomp's default (spin a while, then sleep)."""
    raw = os.environ.get("OMP_WAIT_POLICY", "")
    return raw.lower() if raw else "default"


@dataclass
class Adaptation:
    """One thread-count decision of the monitor (or the init stage): when, why, what it timed,
    what it chose."""

    t: float
    reason: str
    conditions: dict[str, Any]
    timings_ms: dict[int, dict[str, float]]
    before: int
    after: int
    cpus: list[int] | None = None  # the cores pinned to (fewer than all); None: all cores
    recalled: bool = False  # timings_ms are an earlier measurement's, on a machine like this

RECALL_S = 120.0  # an adaptation this recent, on a machine like now's, is applied untimed
StepKey = tuple[str, int, tuple[int, ...], int]  # (mode, batch bucket, shape, context bucket)


class ContentionMonitor:
    """Step-time drift and machine watch for one engine (see the module docstring).

    ``observe(mode, batch, ms)`` after every step. ``passes()`` builds the timed GEMM passes
    (lazily, so a monitor that never adapts costs nothing). ``enabled`` False: observe only.
    ``log`` keeps every :class:`Adaptation`; ``on_change(adaptation)`` is called after each."""

    def __init__(self, default_threads: int, passes: Callable[[], dict[str, Callable[[], None]]],
                 enabled: bool = True,
                 on_change: Callable[[Adaptation], None] | None = None) -> None:
        self.default = max(1, default_threads)
        self.enabled = enabled and self.default > 1
        self._make_passes = passes
        self._passes: dict[str, Callable[[], None]] | None = None
        self.on_change = on_change
        self.windows: dict[StepKey, deque[float]] = {}
        self.calibration: dict[StepKey, float] = {}
        # drifts on a quiet machine, taken as the workload's own: re-calibrated, never timed
        self.recalibrations = 0
        self.drift: float | None = None
        self.log: list[Adaptation] = []
        self.cpus: list[int] | None = None  # the cores this monitor pinned the process to
        self._sample = cpu_sample()
        self._next_check = time.perf_counter() + CHECK_S
        self._last_check = time.perf_counter()
        self._last_adapt = -math.inf
        self._backoff = BACKOFF_S[0]
        self._last_cond: Conditions | None = None  # what the last measurement saw
        self._resolved_at = -math.inf  # an unresolved look waits for its window until then
        self._steal_seen = False  # the last look found steal alone over its share

    @staticmethod
    def key(mode: str, batch: int, shape: Sequence[int] | None = None,
            context: int = 0) -> StepKey:
        """What a step's time is compared against: steps of one mode, batch bucket, tree
        shape and context bucket (powers of two). A chain step and an S6K8N32 step, or a step
        at 100 and at 1000 tokens of context, cost different times on a quiet machine: one
        calibration for both read the workload's own change as drift (issue 26: a quiet
        ``bench spec`` re-timed the thread counts inside its timed arms)."""
        return (mode, 1 << max(0, batch - 1).bit_length(), tuple(shape or ()),
                max(0, context).bit_length())

    def observe(self, mode: str, batch: int, ms: float, shape: Sequence[int] | None = None,
                context: int = 0) -> Adaptation | None:
        """Record one step; maybe re-time the thread counts (returns the adaptation, if any)."""
        k = self.key(mode, batch, shape, context)
        w = self.windows.setdefault(k, deque(maxlen=WINDOW))
        w.append(ms)
        if len(w) == WINDOW:
            med = statistics.median(w)
            cal = self.calibration.get(k)
            # the best window at this thread count is the calibration; a window at another
            # thread count starts a new one (the monitor clears them when it switches)
            self.calibration[k] = med if cal is None else min(cal, med)
            self.drift = med / self.calibration[k]
        if not self.enabled:
            return None
        now = time.perf_counter()
        cal = self.calibration.get(k)
        # a drift, or one step far over its calibration (a neighbour arrived: the window's
        # median would take WINDOW slow steps to say so), asks before the periodic look —
        # the machine's counters then decide — but not before the back-off has passed
        drifted = (self.drift is not None and self.drift >= DRIFT) or \
            (cal is not None and ms >= SPIKE * cal)
        if now < self._next_check and not (drifted and now >= max(
                self._last_adapt + self._backoff, self._resolved_at)):
            return None
        return self.check(now)

    def check(self, now: float | None = None) -> Adaptation | None:
        """Look at the machine since the last check; re-time the thread counts when the steps
        drifted, or the machine is busy at all cores, or quiet at fewer."""
        now = time.perf_counter() if now is None else now
        self._last_check = now
        prev, sample = self._sample, cpu_sample()
        cond = between(prev, sample, self.drift)
        if cond.others is None and prev is not None and sample is not None:
            # a window too short for /proc/stat's ticks (a drift asks early): ask again once
            # it resolves, rather than sleep inside a step or read the drift as contention
            self._next_check = self._resolved_at = prev.wall + RESOLVE_S
            return None
        self._sample = sample
        threads = torch.get_num_threads()
        busy = bool(dataclasses.replace(cond, drift=None).reasons())
        drifted = self.drift is not None and self.drift >= DRIFT
        # pinned to fewer cores, with the neighbours now on ours and another core free
        stale_pin = busy and prev is not None and sample is not None and affinity.crowded(
            prev.cpus, sample.cpus, sample.wall - prev.wall, self.cpus, OTHERS_CORES,
            others_s(prev, sample))
        self._next_check = now + CHECK_S  # looks stay cheap and regular, whatever the back-off
        # steal alone (nobody else in the VM) comes in bursts of a look from a busy host: two
        # looks in a row before re-timing (seen on the 2-core EPYC: an 11 % burst flipped a
        # quiet run to one thread and back, ~0.5 s of stalls; a neighbour shows as others)
        steal_only = busy and cond.others is not None and cond.others < OTHERS_CORES
        confirm, self._steal_seen = steal_only and not self._steal_seen, steal_only
        if confirm and threads == self.default:
            return None
        if drifted and not busy and cond.others is not None and threads == self.default:
            # a quiet machine, every core in use: the slower steps are the workload's own
            # (longer contexts, another mix of step kinds); re-timing would only stall the run
            # (≈ 0.3 s, inside a benchmark's timed arm). Their present cost is the calibration.
            self._recalibrate()
            self.recalibrations += 1
            return None
        if busy and threads == 1:
            fits = not stale_pin  # nothing below one thread, and more lose beside other work
        elif drifted:
            fits = False  # something changed that the machine's counters do not show
        else:
            fits = busy == (threads < self.default) and not stale_pin
        if fits or (now < self._last_adapt + self._backoff and not stale_pin
                    and not self._changed(cond)):
            return None  # (or: the same machine the last measurement confirmed, not yet again)
        why = "; ".join(cond.reasons()) or "quiet again"
        if stale_pin:
            why += f"; others on our core(s) {self.cpus} while another is free"
        a = self.adapt(cond, why, (prev, sample))
        self._last_adapt = time.perf_counter()
        self._last_cond = cond
        if a.after == a.before:  # confirmed: wait longer before measuring the same again
            self._backoff = min(BACKOFF_S[1], self._backoff * 2)
        else:
            self._backoff = BACKOFF_S[0]
        self._next_check = time.perf_counter() + CHECK_S
        return a

    def _changed(self, cond: Conditions) -> bool:
        """Is the machine another than the last measurement saw (others' use moved by a third
        of a core, or the busy verdict flipped)? The back-off is for one that keeps confirming."""
        last = self._last_cond
        if last is None or (cond.others is not None and last.others is not None and
                            abs(cond.others - last.others) >= OTHERS_CORES):
            return True
        return dataclasses.replace(cond, drift=None).contended != \
            dataclasses.replace(last, drift=None).contended

    def _recalibrate(self) -> None:
        """The steps' present cost is their calibration from here on."""
        for k, w in self.windows.items():
            if w:
                self.calibration[k] = statistics.median(w)
        self.drift = None

    def adapt(self, cond: Conditions, reason: str,
              window: tuple[CpuSample | None, CpuSample | None] = (None, None)) -> Adaptation:
        """Time the candidate thread counts now and apply the fastest; ``window``, the look
        that found ``cond``, places the threads where it can tell (else a look of its own)."""
        if self._passes is None:
            self._passes = self._make_passes()
        before, pinned_before = torch.get_num_threads(), self.cpus
        cands = thread_candidates(self.default, cond)
        known = None
        timings: dict[int, dict[str, float]] = {}
        # under contention fewer threads run on the cores the others leave free (affinity.py)
        order = (self._order(*window) or affinity.quiet_cpus()) if cond.contended else None
        if not cond.contended:  # all cores, untimed, as the init stage gives a quiet machine
            reason += "; all cores, as on a quiet start"  # (a re-timing stalls ~0.3 s)
        elif (known := self._recall(cond, cands)) is not None:  # a job that comes and goes
            timings = dict(known.timings_ms)
            reason += f"; as timed {time.time() - known.t:.0f} s ago on a machine like this"
        else:
            timings = time_threads(self._passes, cands, pin=lambda n: affinity.pin(n, order))
        after = pick_threads(timings, self.default) if timings else self.default
        self.cpus = affinity.pin(after, order)
        if after != before or self.cpus != pinned_before:
            torch.set_num_threads(after)
            self.windows.clear()  # step times at another thread count: a new calibration
            self.calibration.clear()
        else:  # confirmed: the steps' present cost is their calibration from here on
            self._recalibrate()
        self.drift = None
        a = Adaptation(time.time(), reason, cond.to_dict(), timings, before, after, self.cpus,
                       known is not None)
        self.log.append(a)
        if self.on_change is not None:
            self.on_change(a)
        return a

    def _order(self, a: CpuSample | None, b: CpuSample | None) -> list[int] | None:
        """The home CPUs, least used by others first, over the look ``a`` → ``b`` that found
        the machine busy (``affinity.quiet_from``); None where that window cannot tell."""
        if a is None or b is None:
            return None
        return affinity.quiet_from(a.cpus, b.cpus, b.wall - a.wall, b.own - a.own, self.cpus,
                                   OTHERS_CORES)

    def _recall(self, cond: Conditions, cands: tuple[int, ...]) -> Adaptation | None:
        """The latest timed adaptation of the last RECALL_S s on a machine like ``cond`` (same
        verdict and candidates, others' use within a sixth of a core): re-timing would stall
        the engine ~0.3-0.6 s to relearn it. A wrong recall shows as drift: re-timed then."""
        for a in reversed(self.log):
            if time.time() - a.t > RECALL_S:
                return None
            c = a.conditions
            if a.recalled or tuple(a.timings_ms) != cands or c["contended"] != cond.contended:
                continue
            if c["others"] is None or cond.others is None or \
                    abs(c["others"] - cond.others) >= OTHERS_CORES / 2:
                continue
            return a
        return None
