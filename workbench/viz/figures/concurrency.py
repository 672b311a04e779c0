"""Arms under load: throughput and latency vs concurrency with crossovers, speedup vs batch
size with intervals and sanity flags, latency CDFs."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.viz.figures.style import (
    FLAG_MARK,
    HEIGHT,
    MIN_P99_SAMPLES,
    WIDTH,
    arm_order,
    arm_style,
    dress,
    interval_color,
    percentile_text,
    require,
    tick_log_axis,
)
from workbench.viz.prose import ABOVE, BELOW, UNRESOLVED, verdict

if TYPE_CHECKING:
    import pandas as pd


# Columns ``concurrency_curves`` reads. Latencies may be in ms (``*_ms``, preferred: the
# workbench.bench.concurrency table) or in seconds without the suffix (converted to ms).
CONCURRENCY_COLUMNS = {
    "required": ("arm", "concurrency", "tok_s"),
    "latency": ("itl_p50_ms", "ttft_p50_ms", "itl_p99_ms", "ttft_p99_ms"),
    "optional": ("tau", "spec_share", "tok_s_lo", "tok_s_hi"),
}


def _latency_ms(df: pd.DataFrame, name: str) -> pd.Series | None:
    if f"{name}_ms" in df.columns:
        return df[f"{name}_ms"].astype(float)
    if name in df.columns:
        return df[name].astype(float) * 1e3
    return None


def crossovers(df: pd.DataFrame, baseline: str = "baseline",
               value: str = "tok_s") -> dict[str, float | None]:
    """For each non-baseline arm, the concurrency where its ``value`` first drops below the
    baseline's, by linear interpolation in log2 concurrency between the two measured points
    around the sign change. None when it never drops below over the concurrencies both arms
    measured, or is below from the lowest one on (no crossover inside the range: read the
    curves). Raises ValueError if ``baseline`` is not an arm."""
    require(df, ("arm", "concurrency", value), "crossovers")
    arms = list(dict.fromkeys(df["arm"]))
    if baseline not in arms:
        raise ValueError(f"crossovers: baseline arm {baseline!r} not in {arms}")
    base = df[df["arm"] == baseline].groupby("concurrency")[value].mean()
    out: dict[str, float | None] = {}
    for arm in arms:
        if arm == baseline:
            continue
        cur = df[df["arm"] == arm].groupby("concurrency")[value].mean()
        cs = sorted(set(base.index) & set(cur.index))
        diff = [float(cur[c] - base[c]) for c in cs]
        out[arm] = None
        for (c0, d0), (c1, d1) in zip(zip(cs, diff, strict=True), zip(cs[1:], diff[1:],
                                                                          strict=True),
                                      strict=False):
            if d0 >= 0 > d1:
                l0, l1 = math.log2(c0), math.log2(c1)
                out[arm] = float(2 ** (l0 + (l1 - l0) * d0 / (d0 - d1)))
                break
    return out


def resolved_crossovers(df: pd.DataFrame, baseline: str = "baseline",
                        ratio: pd.DataFrame | None = None
                        ) -> dict[str, tuple[float, float] | None]:
    """For each non-baseline arm, the pair of measured levels (c_above, c_below) between which
    it falls below the baseline *as the intervals resolve it*: at c_above the arm's interval
    lies wholly above the baseline, at c_below wholly below, and at every level between them
    the intervals cannot tell. None when the intervals resolve no crossover.

    ``ratio`` (arm, concurrency, ratio, ratio_lo, ratio_hi: the paired per-repeat ratio to the
    baseline) decides when given; otherwise the tok/s intervals (``tok_s_lo``/``tok_s_hi``)
    of the arm and the baseline must not overlap. Without any interval: None for every arm."""
    arms = [a for a in dict.fromkeys(df["arm"]) if a != baseline]
    out: dict[str, tuple[float, float] | None] = {}
    for arm in arms:
        sides: dict[float, str] = {}
        if ratio is not None and {"ratio_lo", "ratio_hi"} <= set(ratio.columns):
            for r in ratio[ratio["arm"] == arm].itertuples():
                sides[float(r.concurrency)] = verdict(r.ratio_lo, r.ratio_hi, 1.0)
        elif {"tok_s_lo", "tok_s_hi"} <= set(df.columns):
            base = df[df["arm"] == baseline].set_index("concurrency")
            for r in df[df["arm"] == arm].itertuples():
                if r.concurrency not in base.index:
                    continue
                b = base.loc[r.concurrency]
                sides[float(r.concurrency)] = (
                    ABOVE if r.tok_s_lo > b["tok_s_hi"] else
                    BELOW if r.tok_s_hi < b["tok_s_lo"] else UNRESOLVED)
        out[arm] = None
        last_above = None
        for c in sorted(sides):
            if sides[c] == ABOVE:
                last_above = c
            elif sides[c] == BELOW:
                if last_above is not None:
                    out[arm] = (last_above, c)
                break
    return out


def concurrency_curves(df: pd.DataFrame, baseline: str = "baseline",
                       mark: Sequence[str] = ("eagle3",), width: int = 1100,
                       height: int = 440, ratio: pd.DataFrame | None = None) -> go.Figure:
    """Throughput and latency vs concurrency for every arm, crossover marked.

    ``df``: one row per (arm, concurrency) with the columns of :data:`CONCURRENCY_COLUMNS`
    (``workbench.bench.concurrency`` writes arm, concurrency, tok_s, ttft_p50_ms, ttft_p99_ms,
    itl_p50_ms, itl_p99_ms, tau, spec_share; optional ``tok_s_lo``/``tok_s_hi`` draw error
    bars). Three panels, each on its own axis: tok/s (traces named by arm), ITL p50
    (``<arm> ITL``, log scale) and TTFT p50 (``<arm> TTFT``, log scale); x is log2. Each arm
    keeps one style (:func:`arm_style`) and the baseline is drawn last. Latency axes are
    ticked 1, 2, 5, 10, 20, 50 … ms. The arms in ``mark`` get a crossover *band* only where
    the intervals resolve one (:func:`resolved_crossovers`, from ``ratio`` or the tok/s
    intervals): shaded between the last level where the arm is faster and the first where it
    is slower, labelled, stacked so labels never overlap; otherwise a note says the crossover
    is not resolved at this noise. Rows with a non-empty ``flags`` column get a ⚠ marker.
    """
    require(df, CONCURRENCY_COLUMNS["required"], "concurrency_curves")
    arms = list(dict.fromkeys(df["arm"]))
    itl = _latency_ms(df, "itl_p50")
    ttft = _latency_ms(df, "ttft_p50")
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.07,
                        subplot_titles=("throughput (all requests)", "inter-token latency p50",
                                        "time to first token p50"))
    for i, arm in enumerate(arm_order(arms, baseline)):
        st = arm_style(str(arm), i)
        line = dict(color=st["color"], width=st["width"], dash=st["dash"])
        g = df[df["arm"] == arm].sort_values("concurrency")
        err = None
        if {"tok_s_lo", "tok_s_hi"} <= set(g.columns):
            err = dict(type="data", symmetric=False, array=(g["tok_s_hi"] - g["tok_s"]).tolist(),
                       # a throughput interval ends at 0 tok/s
                       arrayminus=np.minimum(g["tok_s"] - g["tok_s_lo"], g["tok_s"]).tolist(),
                       color=st["color"], thickness=1.2, width=4)
        fig.add_trace(go.Scatter(x=g["concurrency"], y=g["tok_s"], mode="lines+markers",
                                 name=str(arm), legendgroup=str(arm), line=line, error_y=err,
                                 hovertemplate="c=%{x}: %{y:.0f} tok/s<extra>" +
                                               html.escape(str(arm)) + "</extra>"),
                      row=1, col=1)
        if itl is not None:
            fig.add_trace(go.Scatter(x=g["concurrency"], y=itl[g.index], mode="lines+markers",
                                     name=f"{arm} ITL", legendgroup=str(arm), showlegend=False,
                                     line=line, hovertemplate="c=%{x}: ITL %{y:.1f} ms<extra>"
                                     + html.escape(str(arm)) + "</extra>"), row=1, col=2)
        if ttft is not None:
            fig.add_trace(go.Scatter(x=g["concurrency"], y=ttft[g.index], mode="lines+markers",
                                     name=f"{arm} TTFT", legendgroup=str(arm), showlegend=False,
                                     line=line, hovertemplate="c=%{x}: TTFT %{y:.0f} ms<extra>"
                                     + html.escape(str(arm)) + "</extra>"), row=1, col=3)
    # explicit range (log10 units): annotations would otherwise stretch the autorange
    cs = [float(c) for c in df["concurrency"] if c > 0]
    lo, hi = (math.log10(min(cs)), math.log10(max(cs))) if cs else (0.0, 1.0)
    pad = max(0.08, 0.05 * (hi - lo))
    fig.update_xaxes(title="concurrent requests", type="log", dtick=math.log10(2),
                     range=[lo - pad, hi + pad])
    if baseline in arms:
        found = resolved_crossovers(df, baseline, ratio)
        k = 0
        for arm in [a for a in arms if a in mark and a != baseline]:
            band = found.get(arm)
            color = arm_style(arm)["color"]
            if band is None:
                text = f" {arm}: crossover not resolved at this noise "
                x0 = lo + 0.02 * (hi - lo + 2 * pad)
                anchor = "left"
            else:
                fig.add_vrect(x0=band[0], x1=band[1], fillcolor=color, opacity=0.12,
                              line_width=0, row=1, col=1)
                text = f" {arm} falls below {baseline} between c={band[0]:g} and {band[1]:g} "
                x0 = math.log10(band[1])
                anchor = "right" if x0 > (lo + hi) / 2 else "left"
            fig.add_annotation(x=x0, y=0.04 + 0.09 * k, yref="y domain", xref="x", text=text,
                               showarrow=False, xanchor=anchor, yanchor="bottom",
                               bgcolor="rgba(255,255,255,0.85)", font=dict(color=color,
                                                                           size=11))
            k += 1
    if "flags" in df.columns:
        bad = df[df["flags"].fillna("").astype(str) != ""]
        if len(bad):
            fig.add_trace(go.Scatter(x=bad["concurrency"], y=bad["tok_s"], mode="text",
                                     text=[FLAG_MARK] * len(bad), textposition="top center",
                                     name=f"{FLAG_MARK} sanity flag", showlegend=True,
                                     textfont=dict(color="#8a4b00", size=14),
                                     customdata=bad["flags"].tolist(),
                                     hovertemplate="%{customdata}<extra>flag</extra>"),
                          row=1, col=1)
    top = float(df["tok_s"].max()) if len(df) else 1.0
    # an interval from 2-3 noisy repeats can reach far above every mean: keep the means readable
    fig.update_yaxes(title="tok/s", range=[0, 1.3 * top], row=1, col=1)
    fig.update_yaxes(title="ms (log)", row=1, col=2)
    fig.update_yaxes(title="ms (log)", row=1, col=3)
    if itl is not None:
        tick_log_axis(fig, itl.tolist(), row=1, col=2)
    if ttft is not None:
        tick_log_axis(fig, ttft.tolist(), row=1, col=3)
    return dress(fig, "Throughput and latency vs concurrency", width, height,
                 legend=dict(orientation="h", y=-0.22, x=0), margin=dict(l=60, r=20, t=70,
                                                                         b=100))


def speedup_vs_batch(df: pd.DataFrame, value: str = "vs_baseline", baseline: str = "baseline",
                     width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Speedup over the baseline against concurrency, one line per arm, with confidence
    intervals: ``df`` has arm, concurrency, ``<value>`` (mean over repeats) and optionally
    ``<value>_lo``/``<value>_hi`` (e.g. ``bench.sanity.ci_columns``), ``n`` (repeats, drawn
    beside each point) and ``flags`` (sanity codes; a flagged point has a brown ring and ⚠
    beside it, the codes in the subtitle and hover). A marker is filled green/red only when
    its interval lies wholly above/below 1×, grey when it straddles 1× (the line keeps the
    arm's colour). The baseline is the dashed 1.0× line."""
    require(df, ("arm", "concurrency", value), "speedup_vs_batch")
    fig = go.Figure()
    arms = [a for a in dict.fromkeys(df["arm"]) if a != baseline]
    has_ci = {f"{value}_lo", f"{value}_hi"} <= set(df.columns)
    seen_codes: set[str] = set()
    for i, arm in enumerate(arms):
        st = arm_style(str(arm), i)
        g = df[df["arm"] == arm].sort_values("concurrency")
        err = None
        if has_ci:
            err = dict(type="data", symmetric=False,
                       array=(g[f"{value}_hi"] - g[value]).tolist(),
                       arrayminus=(g[value] - g[f"{value}_lo"]).tolist(), color=st["color"],
                       thickness=1.5, width=5)
        codes = g["flags"].fillna("").astype(str).tolist() if "flags" in g else [""] * len(g)
        flagged = [bool(c) for c in codes]
        n = g["n"].tolist() if "n" in g else [None] * len(g)
        fills = [interval_color(lo, hi) for lo, hi in zip(
            g[f"{value}_lo"] if has_ci else [None] * len(g),
            g[f"{value}_hi"] if has_ci else [None] * len(g), strict=True)]
        text = [(f"n={k}" if k is not None else "") + (f" {FLAG_MARK}" if c else "")
                for k, c in zip(n, codes, strict=True)]
        seen_codes.update(x for c in codes for x in c.split(",") if x)
        fig.add_trace(go.Scatter(
            x=g["concurrency"], y=g[value], mode="lines+markers+text", name=str(arm),
            error_y=err, text=text, textposition="middle right",
            textfont=dict(size=10, color=["#8a4b00" if f else "#666666" for f in flagged]),
            line=dict(color=st["color"], width=st["width"], dash=st["dash"]),
            marker=dict(size=[13 if f else 10 for f in flagged], color=fills,
                        line=dict(color=["#8a4b00" if f else st["color"] for f in flagged],
                                  width=[3 if f else 2 for f in flagged]),
                        symbol=["circle-dot" if f else "circle" for f in flagged]),
            customdata=list(zip([k if k is not None else "" for k in n],
                                [c or "none" for c in codes], strict=True)),
            hovertemplate="c=%{x}: %{y:.3f}× (n=%{customdata[0]})<br>flags: %{customdata[1]}"
                          "<extra>" + html.escape(str(arm)) + "</extra>"))
    fig.add_hline(y=1.0, line=dict(color="#111111", dash="dash"),
                  annotation_text="baseline", annotation_position="bottom right")
    cs = [float(c) for c in df["concurrency"] if c > 0] or [1.0]
    lo, hi = math.log10(min(cs)), math.log10(max(cs))
    # room on the right for the n / ⚠ labels of the last level
    fig.update_xaxes(title="concurrent requests", type="log", dtick=math.log10(2),
                     range=[lo - 0.08, hi + 0.08 + 0.12 * max(hi - lo, 0.3)])
    top = float(df[value].max()) if len(df) else 1.0
    fig.update_yaxes(title="tok/s ÷ baseline's (95 % CI over repeats)",
                     range=[0, max(2.0, 1.4 * top)])  # wide intervals run off the top
    legend = (f"{FLAG_MARK} = sanity flag: {', '.join(sorted(seen_codes))}" if seen_codes
              else "no sanity flags")
    return dress(fig, "Speedup vs batch size (mean and 95 % interval over repeats)<br><sup>"
                      "marker filled green/red only when the interval is wholly above/below "
                      f"1×, grey when it straddles 1×; {legend}</sup>",
                 width, height + 30, margin=dict(l=60, r=30, t=80, b=50))


def latency_cdf(samples: pd.DataFrame, metric: str, by: str = "arm",
                dash_by: str | None = None, log_x: bool = True, width: int = WIDTH,
                height: int = 400) -> go.Figure:
    """Empirical CDF of one latency ``metric`` (a column in ms, e.g. ``ttft_ms``) from a table
    of samples (one row per token gap or request), one line per group of ``by`` (coloured as
    :func:`arm_style`) and, given ``dash_by`` (e.g. ``concurrency``), per value of it (one dash
    each). Each legend entry gives the line's n, its p50 and its p99 — the p99 only from at
    least :data:`~workbench.viz.figures.style.MIN_P99_SAMPLES` samples (else "p99 n/a (n = 8
    < 100)": the largest of 8 samples is not a 99th percentile); × markers at the estimated
    percentiles. x is log scale by default, ticked 1, 2, 5, 10 … ms."""
    require(samples, (by, metric) + ((dash_by,) if dash_by else ()), "latency_cdf")
    fig = go.Figure()
    groups = arm_order(list(dict.fromkeys(samples[by])), "baseline")
    dashes = list(dict.fromkeys(samples[dash_by])) if dash_by else [None]
    styles = ("solid", "dash", "dot", "dashdot")
    for i, key in enumerate(groups):
        st = arm_style(str(key), i)
        for j, dv in enumerate(dashes):
            sel = samples[by] == key
            if dash_by:
                sel &= samples[dash_by] == dv
            xs = np.sort(samples.loc[sel, metric].dropna().to_numpy(dtype=float))
            if not len(xs):
                continue
            ys = np.arange(1, len(xs) + 1) / len(xs)
            p50, _ = percentile_text(xs.tolist(), 50)
            p99, p99_text = percentile_text(xs.tolist(), 99)
            label = f"{key}" + (f" · {dash_by}={dv}" if dash_by else "")
            p99_part = f"p99 {p99:.1f} ms" if p99 is not None else \
                p99_text.replace(f" (n = {len(xs)} < ", " (< ")
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines",
                name=f"{label} (n = {len(xs)}): p50 {p50:.1f} ms · {p99_part}",
                legendgroup=label, line=dict(color=st["color"], width=2.5, shape="hv",
                                             dash=styles[j % len(styles)]),
                hovertemplate="%{x:.1f} ms: %{y:.1%}<extra>" + html.escape(label) +
                              "</extra>"))
            px = [p50] + ([p99] if p99 is not None else [])
            fig.add_trace(go.Scatter(x=px, y=[0.5, 0.99][:len(px)], mode="markers",
                                     name=f"{label} p50/p99", legendgroup=label,
                                     showlegend=False,
                                     marker=dict(color=st["color"], size=9, symbol="x")))
    name = metric.removesuffix("_ms").upper()
    fig.update_xaxes(title=f"{name} (ms" + (", log)" if log_x else ")"),
                     type="log" if log_x else "linear")
    if log_x:
        tick_log_axis(fig, samples[metric].dropna().tolist(), axis="x")
    fig.update_yaxes(title="share of samples ≤ x", range=[0, 1.02], tickformat=".0%")
    return dress(fig, f"{name} distribution (CDF; × = p50, p99 where n ≥ {MIN_P99_SAMPLES})",
                 width, height)
