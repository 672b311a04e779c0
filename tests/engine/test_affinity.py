"""Affinity: fewer threads run on the cores other processes leave free, and all cores come back.

Real ``sched_setaffinity`` throughout (Linux, two cores or more). Where the monitor decides
from a window of ``/proc/stat``, the window is staged (:func:`staged`: a neighbour on one CPU,
the others idle), so the verdict never depends on what else the machine runs; one test reads
the real ``/proc/stat`` beside a spinner it starts, and skips, saying so, when another process
on the free core leaves nothing to tell apart."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from workbench.engine import affinity, contention
from workbench.engine.contention import Conditions, ContentionMonitor, CpuSample

pytestmark = pytest.mark.skipif(affinity.HOME is None or len(affinity.HOME) < 2,
                                reason="needs sched_setaffinity and two CPUs or more")


@pytest.fixture()
def spinner() -> Iterator[int]:
    """A CPU-bound process pinned to the last home CPU; yields that CPU."""
    assert affinity.HOME is not None
    cpu = max(affinity.HOME)
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                         preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        time.sleep(0.3)  # let it start spinning
        yield cpu
    finally:
        p.terminate()
        p.wait(10)


def test_quiet_cpus_puts_the_busy_core_last(spinner: int) -> None:
    start = contention.cpu_sample()
    order = affinity.quiet_cpus(0.2)
    assert order is not None and sorted(order) == sorted(affinity.HOME or ())
    free_core(spinner, start, 0.5)  # another process as busy there: no order to stage
    assert order[-1] == spinner


def test_pin_moves_every_thread_and_home_restores() -> None:
    assert affinity.HOME is not None
    ready, stop = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def worker() -> None:
        ready.set()
        stop.wait(10)
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=worker)
    t.start()
    ready.wait(10)
    one = min(affinity.HOME)
    try:
        assert affinity.pin(1, [one]) == [one]
        assert affinity.current() == [one]
        stop.set()
        t.join(10)
        assert seen == [{one}]  # a thread started before the pin moved too
    finally:
        assert affinity.pin(len(affinity.HOME), None) is None
    assert affinity.current() is None and os.sched_getaffinity(0) == set(affinity.HOME)


def test_pin_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        affinity.pin(0, None)
    with pytest.raises(ValueError, match="not this process's"):
        affinity.pin(1, [10_000])
    assert affinity.current() is None


def neighbour_cpu() -> tuple[int, list[int]]:
    """The staged neighbour's CPU (the last home CPU) and the one fewer threads should take."""
    home = sorted(affinity.HOME or ())
    return home[-1], home[:1]


def staged(busy_cpu: int, wall: float, own: float = 0.0,
           own_cpu: int | None = None) -> tuple[CpuSample, CpuSample]:
    """A window of ``wall`` s in which another process kept ``busy_cpu`` fully busy and this
    one used ``own`` CPU seconds on ``own_cpu`` (every other home CPU idle)."""
    home = sorted(affinity.HOME or ())
    a = CpuSample(100.0, 0.0, 0.0, 0.0, 0.0, {c: 0.0 for c in home})
    used = {c: (wall if c == busy_cpu else 0.0) + (own if c == own_cpu and c != busy_cpu else 0.0)
            for c in home}
    b = CpuSample(100.0 + wall, sum(used.values()), 0.0, wall * len(home), own, used)
    return a, b


def test_monitor_pins_fewer_threads_to_the_free_core_and_unpins_when_quiet(
        machine_conditions: dict[str, float], monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy (the look sees a neighbour on the last CPU): the one-thread candidate is timed, and
    then runs, on the core left free; quiet again: all cores and all threads come back."""
    placed: list[list[int] | None] = []
    busy_cpu, free = neighbour_cpu()
    looks = iter([{c: 0 for c in affinity.HOME or ()},
                  {c: 12 if c == busy_cpu else 0 for c in affinity.HOME or ()}])
    monkeypatch.setattr(affinity, "per_cpu_busy", lambda: next(looks))

    def timed(passes: object, cands: tuple[int, ...], budget_s: float = 0.0,
              pin: object = None) -> dict[int, dict[str, float]]:
        for n in cands:
            assert callable(pin)
            pin(n)
            placed.append(affinity.current())
        return {n: {"p": 1.0 if n == 1 else 9.0} for n in cands}  # one thread wins

    monkeypatch.setattr(contention, "time_threads", timed)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = ContentionMonitor(2, lambda: {"p": lambda: None})
        a = m.adapt(Conditions(2, 1.0, others=1.0, steal=0.0, load1=1.0), "a neighbour")
        assert (a.after, a.cpus, m.cpus) == (1, free, free)
        assert affinity.current() == free and placed == [None, free]
        assert os.sched_getaffinity(0) == set(free)
        q = m.adapt(Conditions(2, 1.0, others=0.0, steal=0.0, load1=0.5), "quiet again")
        assert (q.cpus, m.cpus) == (None, None) and affinity.current() is None
        assert os.sched_getaffinity(0) == set(affinity.HOME or ())
    finally:
        affinity.pin(len(affinity.HOME or ()), None)
        torch.set_num_threads(before)


def one_thread_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor's timing, faked: one thread beats two."""
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0,
                        pin=None: {n: {"p": 1.0 if n == 1 else 9.0} for n in cands})


def free_core(spinner: int, start: contention.CpuSample | None, busy: float) -> list[int]:
    """The home CPU the spinner leaves free, as a one-CPU list; the test skips when another
    process used more than ``busy`` of it since ``start`` (the window cannot stage the case)."""
    free = sorted(set(affinity.HOME or ()) - {spinner})[:1]
    end = contention.cpu_sample()
    assert start is not None and end is not None and start.cpus and end.cpus
    wall = end.wall - start.wall
    if (end.cpus[free[0]] - start.cpus[free[0]]) / wall > busy:
        pytest.skip("another process runs on the free core: the window cannot stage the case")
    if (end.cpus[spinner] - start.cpus[spinner]) / wall < 0.8:
        pytest.skip("the spinner's core was not kept busy (steal or a short window): "
                    "the window cannot stage the case")
    return free


def test_monitor_moves_off_a_core_a_neighbour_took(
        machine_conditions: dict[str, float], monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread pinned where a neighbour now spins while another core is free (the
    neighbour moved in after the pin): the next look re-places the thread on the free core —
    at one thread there is nothing to re-time, only where to run."""
    one_thread_wins(monkeypatch)
    busy_cpu, free = neighbour_cpu()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = ContentionMonitor(2, lambda: {"p": lambda: None})
        m.cpus = affinity.pin(1, [busy_cpu])  # a stale pin: the neighbour's core
        machine_conditions["others"] = 1.0
        # the neighbour's core busy all the window: a quarter ours, the rest the neighbour's
        m._sample, end = staged(busy_cpu, 0.4, own=0.1, own_cpu=busy_cpu)
        monkeypatch.setattr(contention, "cpu_sample", lambda: end)
        a = m.check()
        assert a is not None and "others on our core" in a.reason
        assert (a.after, m.cpus) == (1, free) and affinity.current() == free
        assert os.sched_getaffinity(0) == set(free)
    finally:
        affinity.pin(len(affinity.HOME or ()), None)
        torch.set_num_threads(before)


def test_quiet_from_orders_the_cores_by_the_window_it_is_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Others' use of each CPU is its busy time less our own, spread over the CPUs our threads
    could run on; a close call between a busy pair, or a window too short, is no answer."""
    monkeypatch.setattr(affinity, "HOME", frozenset({0, 1}))
    zero = {0: 0.0, 1: 0.0}
    # our two threads used 1 s over both CPUs; CPU 1 was busy a further 0.5 s: a neighbour
    assert affinity.quiet_from(zero, {0: 0.5, 1: 1.0}, 1.0, 1.0, None, 0.35) == [0, 1]
    assert affinity.quiet_from(zero, {0: 1.0, 1: 0.5}, 1.0, 1.0, None, 0.35) == [1, 0]
    # pinned to CPU 1: all our time is there, so CPU 0's busy time is someone else's
    assert affinity.quiet_from(zero, {0: 0.9, 1: 1.0}, 1.0, 1.0, [1], 0.35) == [1, 0]
    # both quiet: any order will do (ties by number)
    assert affinity.quiet_from(zero, {0: 0.55, 1: 0.5}, 1.0, 1.0, None, 0.35) == [1, 0]
    # 0.3 and 0.5 cores: too close to tell from an even-share estimate
    assert affinity.quiet_from(zero, {0: 0.8, 1: 1.0}, 1.0, 1.0, None, 0.35) is None
    assert affinity.quiet_from(zero, {0: 0.0, 1: 0.09}, 0.09, 0.0, None, 0.35) is None  # short
    assert affinity.quiet_from(zero, {0: 0.5}, 1.0, 0.0, None, 0.35) is None  # a CPU unread
    assert affinity.quiet_from(None, zero, 1.0, 0.0, None, 0.35) is None


def test_monitor_places_threads_from_its_own_look_without_sleeping(
        machine_conditions: dict[str, float], monkeypatch: pytest.MonkeyPatch) -> None:
    """The look that found the neighbour already says which core it is on: no second look
    (``quiet_cpus`` sleeps inside the engine's time) before the threads are placed."""
    def no_look(window_s: float = affinity.LOOK_S) -> list[int] | None:
        raise AssertionError("the monitor took a second look")

    monkeypatch.setattr(affinity, "quiet_cpus", no_look)
    one_thread_wins(monkeypatch)
    busy_cpu, free = neighbour_cpu()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = ContentionMonitor(2, lambda: {"p": lambda: None})
        machine_conditions["others"] = 1.0
        m._sample, end = staged(busy_cpu, 0.3)  # the neighbour spins; we rest
        monkeypatch.setattr(contention, "cpu_sample", lambda: end)
        a = m.check()
        assert a is not None and (a.after, a.cpus, m.cpus) == (1, free, free)
        assert affinity.current() == free
    finally:
        affinity.pin(len(affinity.HOME or ()), None)
        torch.set_num_threads(before)
