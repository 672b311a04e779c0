"""workbench.markdown: the cells and tables every card and the real-model report write."""

from __future__ import annotations

import math

import pytest

from workbench import markdown as md


def test_numbers_and_missing_values() -> None:
    assert md.num(1.234) == "1.23" and md.num(101.26, ".1f") == "101.3"
    assert md.num(2, unit="×") == "2.00×"
    assert md.num(None) == md.num(math.nan) == md.MISSING


def test_intervals_in_both_styles() -> None:
    assert md.interval(1.66, 0.75, 3.65, unit="×") == "1.66× (0.75–3.65)"
    assert md.interval(0.5, 0.4, 0.6, style="bracket") == "0.50 [0.40, 0.60]"
    assert md.interval(1.0, None, 2.0) == "1.00"  # no interval measured: the value alone
    assert md.interval(None, 1.0, 2.0) == md.MISSING
    row = {"tok_s": 9.1, "tok_s_lo": 8.7, "tok_s_hi": float("nan")}
    assert md.row_interval(row, "tok_s", ".1f") == "9.1"
    with pytest.raises(ValueError, match="style"):
        md.interval(1.0, 0.5, 1.5, style="round")


def test_table() -> None:
    assert md.table(["a", "b"], [[1, "x"], [2, md.num(None)]]) == (
        "| a | b |\n|---|---|\n| 1 | x |\n| 2 | — |\n")
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        md.table(["a", "b"], [[1]])
