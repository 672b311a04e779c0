"""``bench shapes``: a trained and a random pair of one shape that disagree beyond noise are
flagged (random pairs stand in for trained ones only while they agree)."""

from __future__ import annotations

import pandas as pd

from workbench.bench.sanity import mark
from workbench.bench.shapes import TRAINED_VS_RANDOM, trained_vs_random


def study(random_lo: float, random_hi: float) -> pd.DataFrame:
    return pd.DataFrame([
        {"shape": "shipped (trained)", "random": False, "layers": 18, "hidden": 256,
         "speedup": 1.73, "speedup_lo": 1.6, "speedup_hi": 1.85},
        {"shape": "18x256 (shipped)", "random": True, "layers": 18, "hidden": 256,
         "speedup": (random_lo + random_hi) / 2, "speedup_lo": random_lo,
         "speedup_hi": random_hi},
        {"shape": "36x256", "random": True, "layers": 36, "hidden": 256, "speedup": 1.0,
         "speedup_lo": 0.9, "speedup_hi": 1.1},
    ])


def test_disagreeing_speedups_flag_both_rows_of_that_shape_only() -> None:
    df = study(0.95, 1.05)  # 1.00× against the trained pair's 1.73×
    flags = trained_vs_random(df)
    assert {f.code for f in flags} == {TRAINED_VS_RANDOM} and len(flags) == 2
    assert "1.73×" in flags[0].message and "1.00×" in flags[0].message
    marked = mark(df, flags)
    assert marked["flags"].tolist() == [TRAINED_VS_RANDOM, TRAINED_VS_RANDOM, ""]


def test_agreement_within_noise_is_not_flagged() -> None:
    assert trained_vs_random(study(1.5, 1.9)) == []
    # no intervals at all: nothing to call beyond noise
    assert trained_vs_random(study(1.5, 1.9).drop(columns=["speedup_lo", "speedup_hi"])) == []


def test_plain_step_costs_that_differ_beyond_noise() -> None:
    df = study(1.5, 1.9)
    same = {"shipped (trained)": {"plain_ms": [4.3, 4.2, 4.4, 4.3]},
            "18x256 (shipped)": {"plain_ms": [4.2, 4.4, 4.3, 4.3]}}
    assert trained_vs_random(df, same) == []
    slow = {"shipped (trained)": {"plain_ms": [6.3, 6.2, 6.4, 6.3]},
            "18x256 (shipped)": {"plain_ms": [4.2, 4.4, 4.3, 4.3]}}
    (f, _) = trained_vs_random(df, slow)
    assert "plain step 1.47×" in f.message
