"""Contention: the machine's conditions over a window, the thread-count measurement, the
step-time monitor that re-measures it while the engine runs, and outputs unchanged by it."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.engine import affinity, contention, stages
from workbench.engine.contention import Conditions, ContentionMonitor, CpuSample

# the module's own function (tests/conftest.py pins contention.between inside each test)
REAL_BETWEEN = contention.between


@pytest.fixture()
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_conditions_say_why_they_are_contended() -> None:
    quiet = Conditions(2, 1.0, others=0.1, steal=0.0, load1=3.0)
    assert not quiet.contended  # a lagging load average is no witness once others is measured
    assert quiet.describe().startswith("quiet (others 0.10 cores")
    assert Conditions(2, 1.0, others=None, steal=None, load1=3.0).reasons() == [
        "load 3.0 > 2 cores"]
    busy = Conditions(2, 1.0, others=0.9, steal=0.08, load1=1.0, drift=2.0)
    assert busy.reasons() == ["other processes used 0.90 of 2 cores", "steal 8 %"]
    assert busy.to_dict()["contended"] is True
    # slower steps on a machine where nobody else runs are the workload's own (seen: every
    # quiet `bench spec` read as contended): drift is a witness only where others is unknown
    assert not Conditions(2, 1.0, others=0.0, steal=0.0, load1=1.0, drift=2.0).contended
    assert Conditions(2, 1.0, others=None, steal=None, load1=1.0, drift=2.0).reasons() == [
        "steps 2.0x their calibration"]


def test_between_counts_other_processes_not_our_own_time() -> None:
    a = CpuSample(wall=10.0, busy=100.0, steal=1.0, total=400.0, own=50.0)
    # 1 s: all CPUs busy 1.8 s, of which 1.0 s was this process; 0.1 s stolen of 2.0 s
    b = CpuSample(wall=11.0, busy=101.8, steal=1.1, total=402.0, own=51.0)
    c = REAL_BETWEEN(a, b)
    assert c.others == pytest.approx(0.8) and c.steal == pytest.approx(0.05)
    assert c.contended
    assert REAL_BETWEEN(None, b).others is None  # no /proc/stat: not measured, not guessed
    short = CpuSample(wall=10.01, busy=100.0, steal=1.0, total=400.0, own=50.0)
    assert REAL_BETWEEN(a, short).others is None  # one tick cannot resolve a third of a core


def test_cpu_sample_reads_proc_stat() -> None:
    s = contention.cpu_sample()
    if s is None:
        pytest.skip("no /proc/stat here")
    assert s.total >= s.busy > 0 and s.own >= 0.0


def test_time_threads_takes_turns_and_restores(threads: None) -> None:
    seen: list[int] = []

    def fn() -> None:
        seen.append(torch.get_num_threads())

    torch.set_num_threads(1)
    out = contention.time_threads({"p": fn}, (2, 1), budget_s=0.0, min_rounds=3)
    assert seen == [2, 1] + [2, 1] * 3  # one warm-up each, then turns
    assert set(out) == {2, 1} and set(out[2]) == {"p"}
    assert torch.get_num_threads() == 1


def test_pick_threads_keeps_the_default_within_margin() -> None:
    assert contention.pick_threads({2: {"a": 10.0}, 1: {"a": 9.8}}, 2) == 2
    assert contention.pick_threads({2: {"a": 40.0}, 1: {"a": 9.0}}, 2) == 1
    assert contention.thread_candidates(2) == (2, 1)
    assert contention.thread_candidates(8, Conditions(8, 1.0, 2.4, 0.0, 3.0)) == (8, 5, 1)


def test_monitor_adapts_on_drift_and_returns_when_quiet(
        threads: None, machine_conditions: dict[str, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {2: {"p": 40.0}, 1: {"p": 10.0}}
    timed: list[tuple[int, ...]] = []

    def fake(passes: object, cands: tuple[int, ...], budget_s: float = 0.0,
             pin: object = None) -> dict[int, dict[str, float]]:
        timed.append(cands)
        return {n: answers[n] for n in cands}

    monkeypatch.setattr(contention, "time_threads", fake)
    changes: list[contention.Adaptation] = []
    torch.set_num_threads(2)
    m = ContentionMonitor(2, lambda: {"p": lambda: None}, on_change=changes.append)
    for _ in range(contention.WINDOW):
        m.observe("spec", 1, 10.0)
    assert m.calibration[m.key("spec", 1)] == 10.0 and not changes
    machine_conditions["others"] = 1.0  # a neighbour takes a core: the steps slow down
    for _ in range(contention.WINDOW):
        m.observe("spec", 1, 30.0)
    (a,) = changes
    assert (a.before, a.after) == (2, 1) and torch.get_num_threads() == 1
    assert "other processes used 1.00" in a.reason and a.conditions["contended"]
    assert m.calibration == {}  # a new thread count starts a new calibration
    # the neighbour leaves: the next look finds the machine quiet at fewer threads, and a
    # quiet machine gets all cores untimed, as a quiet start does (no 0.3 s re-timing stall
    # each time a neighbour leaves)
    machine_conditions["others"] = 0.0
    m._next_check = time.perf_counter() - 1.0
    m.observe("spec", 1, 10.0)
    assert [(c.before, c.after) for c in changes] == [(2, 1), (1, 2)]
    assert torch.get_num_threads() == 2 and len(timed) == 1
    assert changes[-1].reason == "quiet again; all cores, as on a quiet start"
    assert changes[-1].timings_ms == {} and not changes[-1].conditions["contended"]


def test_monitor_backs_off_when_the_measurement_confirms(
        threads: None, machine_conditions: dict[str, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0, pin=None:
                        {n: {"p": 10.0} for n in cands})  # both counts alike: keep the default
    torch.set_num_threads(2)
    m = ContentionMonitor(2, lambda: {"p": lambda: None})
    machine_conditions["others"] = 0.6
    a = m.check()
    assert a is not None and (a.before, a.after) == (2, 2)
    assert m._backoff > contention.BACKOFF_S[0]
    # the next looks come as usual, but the same machine is not measured again yet
    assert m.check() is None and len(m.log) == 1
    m._next_check = 0.0
    assert m.observe("plain", 1, 5.0) is None and len(m.log) == 1


def test_a_changed_machine_is_measured_again_inside_the_back_off(
        threads: None, machine_conditions: dict[str, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The back-off is for a machine that keeps confirming one choice: a neighbour that takes
    a whole core more is a new machine, measured at the next look (seen: 8 s per prompt at two
    collapsing threads while a 60 s back-off from earlier confirmations held the monitor)."""
    answers = {2: {"p": 10.0}, 1: {"p": 10.0}}
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0,
                        pin=None: {n: answers[n] for n in cands})
    torch.set_num_threads(2)
    m = ContentionMonitor(2, lambda: {"p": lambda: None})
    machine_conditions["others"] = 0.4
    for _ in range(3):  # confirmations: the back-off grows
        m._last_adapt = -math.inf
        assert m.check() is not None
    assert m._backoff >= 4 * contention.BACKOFF_S[0] and torch.get_num_threads() == 2
    machine_conditions["others"] = 1.0
    answers[1] = {"p": 2.0}
    a = m.check()
    assert a is not None and (a.before, a.after) == (2, 1)


def test_crowded_reads_a_stale_pin_from_per_cpu_counters() -> None:
    """Pinned to CPU 0: others' use there = all others' use less the busy time of the CPUs we
    may not run on; stale when that is a third of a core and another of ours is half idle."""
    home = sorted(contention.affinity.HOME or ())
    if len(home) < 2:
        pytest.skip("needs two CPUs")
    c0, c1 = home[0], home[1]
    crowded, t = contention.affinity.crowded, contention.OTHERS_CORES
    zero = dict.fromkeys(home, 0.0)
    # over 1 s, c0 was busy throughout, half ours and half a neighbour's; c1 idle → stale
    assert crowded(zero, {**zero, c0: 1.0}, 1.0, [c0], t, others_s=0.5)
    # the neighbour on c1 (where we cannot run): not our problem
    assert not crowded(zero, {**zero, c0: 1.0, c1: 0.9}, 1.0, [c0], t, others_s=0.9)
    assert not crowded(zero, {**zero, c0: 1.0}, 1.0, None, t, others_s=0.5)  # not pinned
    assert not crowded(zero, {**zero, c0: 0.03}, 0.03, [c0], t, others_s=0.01)  # unresolved


def test_monitor_at_one_thread_on_a_busy_machine_does_not_thrash(
        threads: None, machine_conditions: dict[str, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen under load 5-7: steps drifting 1.5-1.7x at one thread re-measured 20 times in a
    minute, each confirming one thread. Nothing below one thread can help: no measurement."""
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0, pin=None:
                        calls.append(cands) or {n: {"p": 1.0} for n in cands})
    torch.set_num_threads(1)
    m = ContentionMonitor(2, lambda: {"p": lambda: None})
    machine_conditions["others"] = 1.6
    for ms in [10.0] * contention.WINDOW + [16.0] * (3 * contention.WINDOW):
        m._next_check = 0.0  # every step looks
        m.observe("spec", 1, ms)
    assert m.drift is not None and m.drift >= contention.DRIFT and calls == []
    machine_conditions["others"] = 0.0  # quiet again: all cores, untimed (as a quiet start)
    a = m.check()
    assert a is not None and (a.before, a.after) == (1, 2) and calls == []


def test_monitor_keys_steps_by_shape_and_context(
        threads: None, machine_conditions: dict[str, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: on a quiet machine a bench's chain steps calibrated the "spec" key and its
    S6K8N32 steps (1.5x dearer) read as drift, so the thread counts were re-timed inside the
    timed arms. Steps of another tree shape or context bucket have their own calibration."""
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0, pin=None:
                        calls.append(cands) or {n: {"p": 1.0} for n in cands})
    torch.set_num_threads(2)
    m = ContentionMonitor(2, lambda: {"p": lambda: None})
    assert m.key("spec", 1, (5, 1, 6), 100) != m.key("spec", 1, (6, 8, 32), 100)
    assert m.key("spec", 1, (5, 1, 6), 100) != m.key("spec", 1, (5, 1, 6), 1000)
    assert m.key("spec", 3, (5, 1, 6), 100) == m.key("spec", 4, (5, 1, 6), 127)
    machine_conditions["others"] = None  # type: ignore[assignment]  # counters unreadable
    for _ in range(2):  # arms alternate, as bench spec interleaves them per prompt
        for shape, ms in (((5, 1, 6), 10.0), ((6, 8, 32), 30.0)):
            for _ in range(contention.WINDOW):
                m._next_check = 0.0  # every step looks
                m.observe("spec", 1, ms, shape, 100)
    assert m.drift == 1.0 and calls == [] and len(m.calibration) == 2


def test_monitor_recalibrates_a_drift_on_a_quiet_machine(
        threads: None, machine_conditions: dict[str, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps slower than their calibration while the counters see nobody else and every core
    is in use: the workload's own change, so no thread timing (≈ 0.3 s inside a timed arm),
    the present cost becomes the calibration. The same drift with a neighbour is timed."""
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0, pin=None:
                        calls.append(cands) or {n: {"p": 1.0} for n in cands})
    torch.set_num_threads(2)
    m = ContentionMonitor(2, lambda: {"p": lambda: None})
    for ms in [10.0] * contention.WINDOW + [20.0] * contention.WINDOW:
        m._next_check = 0.0
        assert m.observe("spec", 1, ms) is None
    assert calls == [] and m.recalibrations >= 1 and m.log == []
    assert m.calibration[m.key("spec", 1)] >= 15.0  # the drifted window's median
    assert m.drift is not None and m.drift < contention.DRIFT
    machine_conditions["others"] = 1.0  # a neighbour: the next drift is timed
    for ms in [45.0] * contention.WINDOW:  # a drift asks before the periodic look
        m.observe("spec", 1, ms)
    assert calls == [(2, 1)] and len(m.log) == 1


def test_monitor_with_one_default_thread_never_adapts() -> None:
    m = ContentionMonitor(1, lambda: {})
    assert not m.enabled and m.check is not None
    for _ in range(3 * contention.WINDOW):
        assert m.observe("plain", 1, 1.0) is None


def test_thread_changes_do_not_change_outputs(threads: None, micro_target: Path) -> None:
    """The monitor may switch thread counts between steps: outputs are bit-identical."""
    sp = wb.SamplingParams(max_new_tokens=12)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(gemm="onednn")) as e:
        got = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            got[n] = [o.token_ids for o in e.generate(prompts, sp)]
        assert got[1] == got[2]
        x = torch.randn(16, e.runner.target.config.hidden_size)
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(torch.nn.functional.linear(x, e.runner.target.lm_head.weight))
        assert torch.equal(outs[0], outs[1])


def test_engine_records_threads_and_adapts_mid_run(
        threads: None, machine_conditions: dict[str, float], micro_target: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy at init: the thread count is measured and provisional. Then the machine turns
    busy and quiet at every look, and each re-measurement flips the thread count between
    steps: the output stays the one of a run without any flip."""
    busy = {"now": True}

    def measured(passes: object, cands: tuple[int, ...], budget_s: float = 0.0,
                 pin: object = None) -> dict[int, dict[str, float]]:
        fast = 1 if busy["now"] else max(cands)  # one thread wins while a neighbour runs
        return {n: {"p": 1.0 if n == fast else 9.0} for n in cands}

    monkeypatch.setattr(contention, "time_threads", measured)
    torch.set_num_threads(2)
    machine_conditions["others"] = 1.1
    with wb.Engine.from_pretrained(micro_target) as e:
        th = e.choices["threads"]
        assert (th["choice"], th["source"], th["provisional"]) == ("1", "measured", True)
        assert th["candidates"] == ["2", "1"] and set(th["timings_ms"]) == {"2", "1"}
        assert torch.get_num_threads() == 1
        assert e.choices["omp_wait"]["source"] == "only"
        assert e.contention is not None and e.contention.default == 2
        sp = wb.SamplingParams(max_new_tokens=24)
        e.contention.enabled = False
        ref = e.generate([[5, 6, 7, 8]], sp)[0].token_ids
        e.contention.enabled = True

        def flip(a: contention.Adaptation) -> None:
            stages.threads_adapted(e, a)
            busy["now"] = not busy["now"]
            machine_conditions["others"] = 1.1 if busy["now"] else 0.0

        e.contention.on_change = flip
        busy["now"], machine_conditions["others"] = False, 0.0
        monkeypatch.setattr(contention, "CHECK_S", 0.0)
        monkeypatch.setattr(contention, "BACKOFF_S", (0.0, 0.0))
        e.contention._next_check = 0.0
        again = e.generate([[5, 6, 7, 8]], sp)[0].token_ids
        assert again == ref
        moves = [(a.before, a.after) for a in e.contention.log]
        assert moves[:2] == [(1, 2), (2, 1)] and len(moves) >= 4
        assert e.choices["threads"]["note"].startswith("re-measured")
        # provisional exactly when the re-measurement ran under contention
        assert e.choices["threads"]["provisional"] is \
            bool(e.contention.log[-1].conditions["contended"])
        for contended in (True, False):
            stages.threads_adapted(e, contention.Adaptation(
                0.0, "drift", {"contended": contended, "others": 1.1 if contended else 0.0},
                {1: {"p": 1.0}, 2: {"p": 2.0}}, 2, 1))
            assert e.choices["threads"]["provisional"] is contended


def test_quiet_machine_keeps_all_cores(threads: None, micro_target: Path) -> None:
    torch.set_num_threads(2)
    with wb.Engine.from_pretrained(micro_target) as e:
        th = e.choices["threads"]
        assert (th["choice"], th["source"], th["provisional"]) == ("2", "only", False)
        assert th["note"].startswith("all cores: the machine is quiet")
    with wb.Engine.from_pretrained(micro_target,
                                   config=wb.EngineConfig(contention="off")) as e:
        assert e.contention is None and "contention='off'" in e.choices["threads"]["note"]
    with pytest.raises(wb.ConfigError, match="EngineConfig.contention"):
        wb.EngineConfig(contention="sometimes")  # type: ignore[arg-type]


def test_a_second_engine_sees_the_process_thread_count(
        threads: None, machine_conditions: dict[str, float], micro_target: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bench concurrency builds one engine per arm in one process: the first engine's
    adaptation to one thread must not make the next believe the machine has one core."""
    monkeypatch.setattr(contention, "PROCESS_THREADS", 2)
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0, pin=None:
                        {n: {"p": 1.0 if n == 1 else 9.0} for n in cands})
    machine_conditions["others"] = 1.2
    with wb.Engine.from_pretrained(micro_target) as a, \
            wb.Engine.from_pretrained(micro_target) as b:
        assert torch.get_num_threads() == 1
        for e in (a, b):
            assert e.choices["threads"]["candidates"] == ["2", "1"]
            assert e.contention is not None and e.contention.default == 2
    machine_conditions["others"] = 0.0  # quiet: the next engine takes every core again
    with wb.Engine.from_pretrained(micro_target) as c:
        assert c.choices["threads"]["choice"] == "2" and torch.get_num_threads() == 2


def test_one_step_far_over_its_calibration_asks_the_machine_at_once(
        threads: None, machine_conditions: dict[str, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A neighbour arrives: the first step 3x over its calibration looks at the machine (no
    window of slow steps, no periodic wait); the counters decide — busy adapts, quiet does not."""
    monkeypatch.setattr(contention, "time_threads",
                        lambda passes, cands, budget_s=0.0, pin=None:
                        {n: {"p": 1.0 if n == 1 else 9.0} for n in cands})
    torch.set_num_threads(2)
    m = ContentionMonitor(2, lambda: {"p": lambda: None})
    for _ in range(contention.WINDOW):
        m.observe("spec", 1, 10.0)
    m._next_check = time.perf_counter() + 3600.0  # no periodic look in this test
    m._last_adapt = -1e9
    assert m.observe("spec", 1, 25.0) is None  # under SPIKE x: waits for its window
    assert m.observe("spec", 1, 31.0) is None and not m.log  # quiet machine: a look, no change
    machine_conditions["others"] = 1.0
    m._next_check = time.perf_counter() + 3600.0
    a = m.observe("spec", 1, 31.0)
    assert a is not None and (a.before, a.after) == (2, 1) and "other processes" in a.reason


def test_a_machine_seen_recently_is_recalled_not_re_timed(
        threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A neighbour that comes and goes: the second time the machine looks as it did a moment
    ago, the earlier timings decide at once (re-timing stalls the engine ~0.3-0.6 s); a machine
    unlike any recent one, or one seen longer ago than RECALL_S, is timed."""
    timed: list[tuple[int, ...]] = []
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0,
                        pin=None: timed.append(cands) or {n: {"p": 1.0 if n == 1 else 9.0}
                                                          for n in cands})
    monkeypatch.setattr(contention.affinity, "quiet_cpus", lambda: None)  # no look, no pin
    torch.set_num_threads(2)
    m = ContentionMonitor(2, lambda: {"p": lambda: None})
    busy, quiet = (Conditions(2, 1.0, others=o, steal=0.0, load1=1.0) for o in (1.0, 0.0))
    a = m.adapt(busy, "a neighbour")
    assert not a.recalled and a.after == 1 and len(timed) == 1
    assert m.adapt(quiet, "quiet again").after == 2 and len(timed) == 1  # quiet: untimed
    b = m.adapt(Conditions(2, 1.0, others=0.9, steal=0.0, load1=1.0), "a neighbour")
    assert b.recalled and b.after == 1 and len(timed) == 1 and "as timed" in b.reason
    assert b.timings_ms == a.timings_ms
    m.adapt(Conditions(2, 1.0, others=0.6, steal=0.0, load1=1.0), "half a neighbour")
    assert len(timed) == 2  # unlike any recent machine: timed
    for x in m.log:
        x.t -= contention.RECALL_S + 1
    assert not m.adapt(busy, "a neighbour").recalled and len(timed) == 3


class StagedClock:
    """The module's clock and counters, staged: ``perf_counter`` is what the test set, a sleep
    fails the test, ``cpu_sample`` reads a quiet machine at that instant (the window's length is
    the test's, whatever else the machine runs). Everything else is the real ``time``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        raise AssertionError(f"slept {s} s inside the engine's time")

    def sample(self) -> contention.CpuSample:
        return contention.CpuSample(self.now, 0.0, 0.0, 2 * self.now, 0.0, {0: 0.0, 1: 0.0})

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_a_look_too_short_to_resolve_waits_for_its_window_without_sleeping(
        threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spike asks early, before /proc/stat's ticks can tell: the look returns at once (no
    sleep inside the step) and asks again when the window resolves."""
    monkeypatch.setattr(contention, "between", REAL_BETWEEN)
    clock = StagedClock()
    monkeypatch.setattr(contention, "time", clock)
    monkeypatch.setattr(affinity, "time", clock)
    monkeypatch.setattr(contention, "cpu_sample", clock.sample)
    torch.set_num_threads(2)
    m = ContentionMonitor(2, lambda: {"p": lambda: None})
    clock.now += 0.03  # three ticks: a third of a core cannot be told from none
    assert m.check() is None
    assert m._next_check == m._resolved_at == 1000.0 + contention.RESOLVE_S > clock.now
    m._last_adapt = -math.inf
    for _ in range(contention.WINDOW):
        m.observe("spec", 1, 10.0)
    before = m._sample
    m.observe("spec", 1, 100.0)  # a spike inside the unresolved window: no look yet
    assert m._sample is before
    clock.now += contention.RESOLVE_S
    m.observe("spec", 1, 100.0)  # resolved now: looked (a quiet machine: nothing to change)
    assert m._sample is not before and m._sample.wall == clock.now
    assert torch.get_num_threads() == 2 and not m.log


def test_a_steal_burst_of_one_look_is_not_re_timed(
        threads: None, machine_conditions: dict[str, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Steal alone comes in bursts from a busy host: one look over the share changes nothing
    (no re-timing stall inside a quiet run); a second look in a row re-times. A neighbour in
    the VM (others) is measured at the first look, as before."""
    timed: list[tuple[int, ...]] = []

    def fake(passes: object, cands: tuple[int, ...], budget_s: float = 0.0,
             pin: object = None) -> dict[int, dict[str, float]]:
        timed.append(cands)
        return {n: {"p": 10.0 if n == 1 else 20.0} for n in cands}

    monkeypatch.setattr(contention, "time_threads", fake)
    monkeypatch.setattr(contention.affinity, "quiet_cpus", lambda: None)
    torch.set_num_threads(2)
    m = ContentionMonitor(2, lambda: {"p": lambda: None})
    machine_conditions["steal"] = 0.11  # a burst, nobody else in the VM
    assert m.check() is None and not timed and torch.get_num_threads() == 2
    machine_conditions["steal"] = 0.0  # gone at the next look: still nothing timed
    assert m.check() is None and not timed
    machine_conditions["steal"] = 0.2  # steal that lasts two looks is the machine's
    assert m.check() is None
    a = m.check()
    assert a is not None and "steal 20 %" in a.reason and (a.before, a.after) == (2, 1)
    torch.set_num_threads(2)
    m2 = ContentionMonitor(2, lambda: {"p": lambda: None})
    machine_conditions.update(steal=0.0, others=1.0)  # a neighbour: measured at once
    assert m2.check() is not None and len(timed) == 2
