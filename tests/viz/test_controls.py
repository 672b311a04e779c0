"""The controls over recorded runs: a selection changes the prose and the figure, and the
prose's words follow the recorded intervals."""

from __future__ import annotations

import pandas as pd
import pytest

from workbench.viz import prose as P
from workbench.viz.controls import ShapeControl, ThresholdControl


def sweep() -> pd.DataFrame:
    rows = [(2, 1, 3, 1.8, 1.2, 1.1, 1.3), (2, 2, 4, 2.1, 1.4, 1.2, 1.6),
            (4, 2, 8, 2.6, 1.1, 0.7, 1.6), (4, 4, 8, 2.9, 0.8, 0.7, 0.9)]
    return pd.DataFrame(rows, columns=["num_steps", "topk", "num_draft_tokens", "tau",
                                       "speedup", "speedup_lo", "speedup_hi"]).assign(
        n=4, flags=["", "", "", "loaded"])


def test_shape_control_starts_on_the_fastest_and_follows_the_selection() -> None:
    c = ShapeControl(sweep())
    assert (c.s.value, c.k.value, c.n.value) == (2, 2, 4)
    assert "is faster than the baseline" in c.text.value and P.check_claims(c.text.value) == []
    first = c.figure
    c.select(4, 2, 8)  # 1.1× [0.7–1.6]: not resolved
    assert "not resolved at this noise" in c.text.value and P.check_claims(c.text.value) == []
    assert c.figure is not first and c.box.children == (c.figure,)  # a fresh figure to export
    sel = [t for t in c.figure.data if t.name == "selected"][0]
    assert list(sel.x) == [2.6] and list(sel.y) == [1.1]
    c.select(4, 4, 8)
    assert "is slower than" in c.text.value and "⚠ loaded" in c.text.value
    # the dropdowns keep N valid for (S, K)
    c.k.value = 2
    assert list(c.n.options) == [8] and c.n.value == 8
    with pytest.raises(ValueError, match="not in the recorded sweep"):
        c.select(6, 1, 7)


def concurrency() -> tuple[pd.DataFrame, pd.DataFrame]:
    table = pd.DataFrame({
        "arm": ["baseline"] * 3 + ["eagle3"] * 3 + ["goodput"] * 3,
        "concurrency": [1, 4, 16] * 3,
        "tok_s": [100, 300, 800, 180, 330, 500, 175, 320, 790]})
    ratio = pd.DataFrame({"arm": ["eagle3"] * 3, "concurrency": [1, 4, 16],
                          "ratio": [1.8, 1.1, 0.62], "ratio_lo": [1.6, 0.8, 0.55],
                          "ratio_hi": [2.0, 1.5, 0.7], "n": [3, 3, 3]})
    return table, ratio


def test_threshold_control_composes_a_policy_from_the_sweep() -> None:
    table, ratio = concurrency()
    c = ThresholdControl(table, ratio)
    assert c.select(n=4).tolist() == [180, 330, 800]  # eagle3 up to 4, baseline above
    assert c.select(n=0).tolist() == [100, 300, 800]
    assert c.select(n=16).tolist() == [180, 330, 500]
    c.select(n=4)
    text = c.text.value
    assert "BatchThreshold(4)" in text and "100%–100% of the envelope" in text
    assert P.check_claims(text) == []
    claims = P.parse_claims(text)
    assert [x["verdict"] for x in claims] == [P.ABOVE, P.UNRESOLVED, P.BELOW]
    curve = [t for t in c.figure.data if "BatchThreshold(4)" in t.name][0]
    assert list(curve.y) == [180, 330, 800]
    assert c.select(policy="goodput").tolist() == [175, 320, 790] and c.n.disabled
    with pytest.raises(ValueError, match="policy 'nope'"):
        c.select(policy="nope")
    with pytest.raises(ValueError, match="arm 'eagle3' missing"):
        ThresholdControl(table[table.arm != "eagle3"])
