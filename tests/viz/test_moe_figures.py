"""MoE figures read their frames: coverage markers per kind beside the uniform curve, cost
ratios per target beside the model's."""

from __future__ import annotations

import pandas as pd
import pytest

from workbench.policy.moe_cost import KIMI_K25_INT4, uniform_coverage, what_if
from workbench.viz import figures as F


def test_expert_coverage_figure() -> None:
    df = pd.DataFrame({"kind": ["decode", "decode", "verify"], "tokens": [1, 2, 8],
                       "distinct": [2, 4, 7], "num_experts": [8] * 3, "top_k": [2] * 3})
    fig = F.expert_coverage(df, gamma=0.5)
    names = [t.name for t in fig.data]
    assert names == ["decode", "verify", "uniform routing", "fitted γ = 0.50"]
    uni = fig.data[2]
    assert uni.y[-1] == pytest.approx(uniform_coverage(8, 2, uni.x[-1]))
    assert list(fig.data[1].y) == [7]
    with pytest.raises(ValueError, match="expert_coverage"):
        F.expert_coverage(df.drop(columns=["top_k"]))


def test_cost_ratio_figure_from_a_what_if() -> None:
    box = what_if(KIMI_K25_INT4, [1, 4, 16], num_draft_tokens=4, hbm_gbps=1792, tp=8)
    fig = F.cost_ratio(box.assign(target="kimi", predicted=box["ratio"]))
    assert [t.name for t in fig.data] == ["kimi", "kimi model"]
    assert list(fig.data[0].y) == pytest.approx(list(box["ratio"]))
    assert fig.layout.xaxis.type == "log"
