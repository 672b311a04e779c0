"""Replayed vs measured with intervals and a sign test; no winner inside the replay's error;
the oracle called a bound only where nothing beat it; no p99 from a handful of requests."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from workbench.errors import ConfigError
from workbench.lab.replay import oracle_is_bound, winner
from workbench.lab.sim import _p99
from workbench.lab.validate import against, measured_ratios, sign_test, sign_text
from workbench.viz.figures.style import MIN_P99_SAMPLES


def bench_rows(ratios: dict[str, list[float]], c: int = 1) -> list[dict]:
    rows = []
    for r in range(len(next(iter(ratios.values())))):
        rows.append({"arm": "never", "concurrency": c, "repeat": r, "tok_s": 100.0 + r})
        for arm, xs in ratios.items():
            rows.append({"arm": arm, "concurrency": c, "repeat": r,
                         "tok_s": xs[r] * (100.0 + r)})
    return rows


def test_measured_ratio_has_a_t_interval_over_repeats() -> None:
    m = measured_ratios(bench_rows({"always": [1.4, 1.5, 1.6]})).set_index("policy")
    row = m.loc["always"]
    assert row["measured_vs_never"] == pytest.approx(1.5)
    half = 4.302653 * 0.1 / math.sqrt(3)  # t(0.975, 2) * sd / sqrt(n)
    assert row["measured_hi"] - row["measured_vs_never"] == pytest.approx(half, rel=1e-5)
    assert row["measured_n"] == 3
    one = measured_ratios(bench_rows({"always": [1.5]})).set_index("policy")
    assert one.loc["always", "measured_n"] == 1 and math.isnan(one.loc["always", "measured_lo"])


def test_error_interval_brackets_the_point() -> None:
    replayed = pd.DataFrame({"policy": ["always"], "concurrency": [1], "vs_never": [1.2]})
    out = against(replayed, bench_rows({"always": [1.4, 1.5, 1.6]})).iloc[0]
    assert out["error_lo"] < out["ratio_error"] < out["error_hi"] < 0
    assert out["ratio_error"] == pytest.approx(1.2 / 1.5 - 1)


def test_sign_test_flags_errors_that_share_a_sign() -> None:
    """"Within ±10 % in 8 of 10" can hide a bias: ten positive errors are systematic."""
    lean = pd.DataFrame({"ratio_error": [0.008, 0.02, 0.05, 0.09, 0.01, 0.03, 0.07, 0.29,
                                         0.04, 0.06]})
    t = sign_test(lean)
    assert t["positive"] == 10 and t["p"] == pytest.approx(2 / 1024)
    assert t["systematic"] and "over-predicts systematically" in sign_text(t)
    mixed = pd.DataFrame({"ratio_error": [0.05, -0.04, 0.03, -0.02, 0.01, -0.06]})
    assert not sign_test(mixed)["systematic"]
    few = sign_test(pd.DataFrame({"ratio_error": [0.1, 0.2, 0.3]}))
    assert not few["systematic"] and "too few" in few["note"]


def replayed(regret: dict[str, float], bound: str = "oracle") -> pd.DataFrame:
    rows = [{"policy": p, "concurrency": 1, "regret": r, "bound": bound}
            for p, r in {"never": 0.3, "oracle": 0.0, **regret}.items()]
    return pd.DataFrame(rows)


def test_no_winner_inside_the_replays_error() -> None:
    with pytest.raises(ConfigError, match="no winner: goodput .* sglang .* overlap"):
        winner(replayed({"goodput": 0.372, "sglang": 0.373}))
    assert winner(replayed({"goodput": 0.05, "sglang": 0.45})) == "goodput"


def test_oracle_is_a_bound_only_when_nothing_beat_it() -> None:
    assert oracle_is_bound(replayed({"goodput": 0.1}))
    assert not oracle_is_bound(replayed({"goodput": 0.1}, bound="never"))


def test_no_p99_below_the_minimum() -> None:
    assert math.isnan(_p99([1.0] * (MIN_P99_SAMPLES - 1)))
    assert _p99([float(i) for i in range(MIN_P99_SAMPLES)]) == pytest.approx(98.01)
