"""Sanity blocks on notebook pages, and closed-loop latency samples for the CDF figures."""

from __future__ import annotations

import re

import pandas as pd
import pytest

import workbench as wb
from workbench.bench.sanity import Flag
from workbench.viz import figures as F
from workbench.viz.latency import closed_loop_outputs, latency_rows, latency_samples
from workbench.viz.report import highlight_flagged, sanity_html


def test_sanity_html_counts_flags_for_the_exporter() -> None:
    clean = sanity_html([], "the sweep")
    assert 'class="wb-sanity" data-flags="0"' in clean and "no flags" in clean
    flags = [Flag("loaded", "load 5.1 before the run > 2 cores"),
             Flag("speedup_above_tau", "eagle3: speedup 3.2× > τ 2.5 <b>", {"arm": "eagle3"})]
    html = sanity_html(flags, "the sweep")
    assert re.search(r'class="wb-sanity" data-flags="2" data-codes="loaded,speedup_above_tau"',
                     html)
    assert "load 5.1 before the run" in html and "&lt;b&gt;" in html  # messages escaped
    many = sanity_html([Flag("loaded", f"row {i}") for i in range(10)], "x")
    assert "<code>loaded</code> ×10" in many and "row 2" in many and "row 3" not in many
    assert "and 7 more" in many and 'data-flags="10"' in many


def test_highlight_flagged_paints_flagged_rows() -> None:
    df = pd.DataFrame({"arm": ["a", "b"], "tok_s": [1.0, 2.0], "flags": ["", "loaded"]})
    styler = highlight_flagged(df)
    styler._compute()  # fills styler.ctx: (row, col) → css
    painted = {cell for cell, css in styler.ctx.items() if css}
    assert painted == {(1, 0), (1, 1), (1, 2)}  # the three cells of row b, none of row a
    with pytest.raises(ValueError, match="no column"):
        highlight_flagged(df.drop(columns=["flags"]))


def test_closed_loop_samples_every_request(engine: wb.Engine) -> None:
    spec = wb.SpecConfig(num_steps=3, topk=1)
    prompts = ["def f(x):", "import os\n"]
    outs = closed_loop_outputs(engine, prompts, spec, concurrency=2, num_requests=3,
                               max_new_tokens=6)
    assert len(outs) == 3 and all(len(o.token_ids) == 6 for o in outs)
    assert engine.spec is None  # restored
    rows = pd.DataFrame(latency_rows(outs, arm="eagle3"))
    assert (rows[rows.metric == "ttft"].ms > 0).all() and len(rows[rows.metric == "ttft"]) == 3
    assert len(rows[rows.metric == "tpot"]) == 3 and (rows[rows.metric == "itl"].ms > 0).all()
    lat = latency_samples(engine, prompts, {"baseline": None, "eagle3": spec}, levels=[1],
                          max_new_tokens=4, requests_per_level=2)
    assert set(lat.arm) == {"baseline", "eagle3"} and set(lat.metric) == {"ttft", "tpot", "itl"}
    # plain decode: one emission per token, so 3 gaps per 4-token request
    assert len(lat[(lat.arm == "baseline") & (lat.metric == "itl")]) == 2 * 3
    fig = F.latency_cdf(lat[lat.metric == "itl"].rename(columns={"ms": "itl_ms"}), "itl_ms")
    assert fig.layout.xaxis.type == "log"
    with pytest.raises(ValueError, match="concurrency"):
        closed_loop_outputs(engine, prompts, None, 0, 1, 4)


def test_ratio_ci_is_geometric_and_positive() -> None:
    from workbench.viz.report import ratio_ci

    df = pd.DataFrame({"arm": ["a"] * 3 + ["b"], "speedup": [0.5, 2.0, 1.0, 1.5]})
    out = ratio_ci(df, ["arm"], "speedup").set_index("arm")
    assert out.loc["a", "speedup"] == pytest.approx(1.0)  # (0.5 · 2 · 1)^(1/3)
    assert 0 < out.loc["a", "speedup_lo"] < 1 < out.loc["a", "speedup_hi"]
    assert out.loc["a", "speedup_lo"] * out.loc["a", "speedup_hi"] == pytest.approx(1.0)
    assert out.loc["b", "speedup_lo"] == out.loc["b", "speedup_hi"] == 1.5 and \
        out.loc["b", "n"] == 1
