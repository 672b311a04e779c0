"""engine/thread_timing.py: thread counts timed in turns, and a count that has lost takes no
more turns (a monitor's re-timing stalls the request being served)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

from workbench.engine import contention, thread_timing


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The module's clock, replaced by one only the passes advance: each pass "takes" exactly
    the milliseconds it is given, whatever else runs on the machine (a sleep on a busy core
    oversleeps by a scheduler slice, which would decide these cases instead of the rule)."""
    now = [0.0]
    monkeypatch.setattr(thread_timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def sleeper(ms: dict[int, float], seen: list[int], clock: list[float]) -> Callable[[], None]:
    """A pass that takes ``ms[n]`` at ``n`` threads and notes each call's thread count."""
    def fn() -> None:
        n = torch.get_num_threads()
        seen.append(n)
        clock[0] += ms[n] / 1e3
    return fn


def test_the_monitor_and_the_init_stage_time_with_this_module() -> None:
    assert contention.time_threads is thread_timing.time_threads
    assert contention.gemm_pass is thread_timing.gemm_pass


def test_a_count_that_lost_at_its_warm_up_takes_no_turns(threads: None, clock: list[float]
                                                         ) -> None:
    """A neighbour on a core: two threads ~100 ms a pass, one ~5 ms. After the warm-ups one
    count is left, so nothing more is timed; the loser's figure is its warm-up."""
    seen: list[int] = []
    torch.set_num_threads(1)
    out = thread_timing.time_threads({"p": sleeper({2: 100.0, 1: 5.0}, seen, clock)}, (2, 1),
                                     budget_s=0.0, min_rounds=3)
    assert seen == [2, 1]
    assert out == {2: {"p": pytest.approx(100.0)}, 1: {"p": pytest.approx(5.0)}}
    assert thread_timing.pick_threads(out, 2) == 1
    assert torch.get_num_threads() == 1


def test_the_counts_still_in_the_running_keep_taking_turns(threads: None, clock: list[float]
                                                          ) -> None:
    seen: list[int] = []
    out = thread_timing.time_threads({"p": sleeper({4: 60.0, 2: 6.0, 1: 5.0}, seen, clock)},
                                     (4, 2, 1), budget_s=0.0, min_rounds=3)
    assert seen == [4, 2, 1] + [2, 1] * 3  # 4 lost at the warm-up; 2 and 1 are close
    assert out == {4: {"p": pytest.approx(60.0)}, 2: {"p": pytest.approx(6.0)},
                   1: {"p": pytest.approx(5.0)}}


@pytest.mark.parametrize("ms", [
    {2: 12.5, 1: 5.0},  # 2.5x slower is still in the running: one burst in a turn costs that
    {2: 0.0, 1: 0.0},  # microsecond passes: below a millisecond the ratio is noise
], ids=["within-the-margin", "microseconds"])
def test_a_count_not_clearly_beaten_takes_every_turn(threads: None, ms: dict[int, float],
                                                      clock: list[float]) -> None:
    seen: list[int] = []
    thread_timing.time_threads({"p": sleeper(ms, seen, clock)}, (2, 1), budget_s=0.0, min_rounds=3)
    assert seen == [2, 1] * 4


def test_a_slow_turn_of_the_winner_keeps_the_other_count_in(threads: None, clock: list[float]
                                                            ) -> None:
    """The fastest turn of a count is weighed against the slowest of another: a burst in the
    eventual winner's warm-up (here 40 ms against its 2 ms) keeps the other count timed."""
    seen: list[int] = []
    calls = {1: 0}

    def fn() -> None:
        n = torch.get_num_threads()
        seen.append(n)
        if n == 1:
            calls[1] += 1
        clock[0] += (40.0 if n == 1 and calls[1] == 1 else 2.0 if n == 1 else 30.0) / 1e3

    out = thread_timing.time_threads({"p": fn}, (2, 1), budget_s=0.0, min_rounds=3)
    assert seen == [2, 1] * 4
    assert out[1]["p"] < out[2]["p"]  # the medians of the timed turns, not the warm-up


def test_the_thread_count_is_restored_when_a_pass_fails(threads: None) -> None:
    torch.set_num_threads(1)

    def boom() -> None:
        if torch.get_num_threads() == 2:
            raise RuntimeError("pass failed")

    with pytest.raises(RuntimeError, match="pass failed"):
        thread_timing.time_threads({"p": boom}, (2, 1), budget_s=0.0)
    assert torch.get_num_threads() == 1
