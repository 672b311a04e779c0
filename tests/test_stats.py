"""workbench.stats: the intervals every benchmark, card, figure and page prints (on scipy.stats).

The Student-t quantile used to be hand-rolled (an incomplete-beta continued fraction inverted by
bisection, ``workbench/bench/sanity.py`` up to commit 8610dea); ``OLD_T`` holds what that code
gave at the levels and degrees of freedom the project uses (repeats: df 1-10; Welch and
per-node slopes: up to thousands), and scipy's must agree to 1e-9 so no saved interval moves.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from workbench import stats

OLD_T = {
    0.975: {1: 12.706204735923876, 2: 4.302652729770706, 3: 3.1824463052609886,
            4: 2.7764451052680883, 5: 2.5705818357257826, 6: 2.446911851250455,
            7: 2.364624251627312, 8: 2.3060041353106797, 9: 2.2621571628134163,
            10: 2.2281388519784784, 15: 2.1314495455837523, 20: 2.0859634472514266,
            30: 2.042272456315164, 50: 2.008559112087749, 100: 1.9839715185709927,
            1000: 1.9623390808409802, 10000: 1.9602012399366764},
    0.95: {1: 6.313751514719357, 2: 2.919985580329687, 3: 2.353363434903777,
           4: 2.1318467863795654, 5: 2.0150483733272218, 6: 1.9431802805169873,
           7: 1.8945786050550417, 8: 1.8595480374972162, 9: 1.8331129326143447,
           10: 1.8124611227965381, 15: 1.7530503557128263, 20: 1.724718242945844,
           30: 1.6972608865573058, 50: 1.6759050251446972, 100: 1.6602343260729846,
           1000: 1.64637881733265, 10000: 1.6450060180139836},
}


@pytest.mark.parametrize("p", sorted(OLD_T))
def test_t_quantile_agrees_with_the_hand_rolled_one(p: float) -> None:
    for df, old in OLD_T[p].items():
        assert stats.t_quantile(p, df) == pytest.approx(old, rel=1e-9, abs=0), (p, df)


def test_t_quantile_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="p must be"):
        stats.t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df must be"):
        stats.t_quantile(0.9, 0)


def test_mean_ci_student_t() -> None:
    m, lo, hi = stats.mean_ci([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5
    half = 3.182446305284 * math.sqrt(5 / 3) / 2  # t(0.975, 3) · s / √n
    assert lo == pytest.approx(2.5 - half, rel=1e-9) and hi == pytest.approx(2.5 + half, rel=1e-9)
    assert stats.mean_ci([7.0, None, math.nan]) == (7.0, 7.0, 7.0)
    assert all(math.isnan(x) for x in stats.mean_ci([]))
    with pytest.raises(ValueError, match="conf"):
        stats.mean_ci([1.0, 2.0], conf=1.5)


def test_ci_columns_per_group() -> None:
    df = pd.DataFrame({"arm": ["a", "a", "b", "b"], "tok_s": [1.0, 3.0, 5.0, 5.0]})
    ci = stats.ci_columns(df, ["arm"], "tok_s").set_index("arm")
    assert ci.loc["a", "tok_s"] == 2.0 and ci.loc["a", "tok_s_lo"] < 2.0 < ci.loc["a", "tok_s_hi"]
    assert ci.loc["b", "tok_s_lo"] == ci.loc["b", "tok_s_hi"] == 5.0
    assert list(ci["n"]) == [2, 2]


def test_bootstrap_ratio_brackets_the_ratio_of_sums() -> None:
    point, lo, hi = stats.bootstrap_ratio([3, 4, 5, 2], [1, 2, 2, 1])
    assert point == pytest.approx(14 / 6)
    assert lo <= point <= hi
    assert stats.bootstrap_ratio([3, 4, 5, 2], [1, 2, 2, 1]) == (point, lo, hi)  # seeded
    assert stats.bootstrap_ratio([2, 2], [1, 1])[1:] == (2.0, 2.0)
    with pytest.raises(ValueError, match="equal non-empty"):
        stats.bootstrap_ratio([1.0], [1.0, 2.0])


def test_ratio_of_is_a_geometric_mean_with_a_log_t_interval() -> None:
    m, lo, hi, n = stats.ratio_of([2.0, 8.0])
    assert m == pytest.approx(4.0) and n == 2
    half = OLD_T[0.975][1] * math.log(4.0) / 2  # t · s / √n, s of the logs = log 4 / √2
    assert lo == pytest.approx(4.0 * math.exp(-half)) and hi == pytest.approx(4.0 * math.exp(half))
    assert math.isnan(stats.ratio_of([3.0])[1])
    with pytest.raises(ValueError, match="> 0"):
        stats.ratio_of([1.0, 0.0])


def test_mean_ratio_and_slope() -> None:
    r, lo, hi = stats.mean_ratio([2.0, 2.2, 1.8], [1.0, 1.1, 0.9])
    assert r == pytest.approx(2.0) and lo < 2.0 < hi
    assert math.isnan(stats.mean_ratio([2.0], [1.0, 1.0])[1])
    slope, lo, hi, se, n = stats.slope_ci([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0])
    assert (slope, lo, hi, se, n) == (2.0, 2.0, 2.0, 0.0, 4)
    slope, lo, hi, _, _ = stats.slope_ci([0, 1, 2, 3], [1.0, 3.2, 4.9, 7.1])
    assert lo < slope < hi
    with pytest.raises(stats.NoTrend, match="too few points"):
        stats.slope_ci([0, 1], [0, 1])
    with pytest.raises(stats.NoTrend, match="does not vary"):
        stats.slope_ci([1, 1, 1], [0, 1, 2])
    with pytest.raises(ValueError, match="zip"):  # unequal lengths are an error, not "no trend"
        stats.slope_ci([0, 1, 2], [0, 1])


def test_percentile_interpolates_linearly() -> None:
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert stats.percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert math.isnan(stats.percentile([], 50))
