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

from workbench.viz.figures.style import HEIGHT, WIDTH, arm_order, arm_style, dress, require

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


def concurrency_curves(df: pd.DataFrame, baseline: str = "baseline",
                       mark: Sequence[str] = ("eagle3",), width: int = 1100,
                       height: int = 440) -> go.Figure:
    """Throughput and latency vs concurrency for every arm, crossover marked.

    ``df``: one row per (arm, concurrency) with the columns of :data:`CONCURRENCY_COLUMNS`
    (``workbench.bench.concurrency`` writes arm, concurrency, tok_s, ttft_p50_ms, ttft_p99_ms,
    itl_p50_ms, itl_p99_ms, tau, spec_share; optional ``tok_s_lo``/``tok_s_hi`` draw error
    bars). Three panels, each on its own axis: tok/s (traces named by arm), ITL p50
    (``<arm> ITL``, log scale) and TTFT p50 (``<arm> TTFT``, log scale); x is log2. Each arm
    keeps one style (:func:`arm_style`) and the baseline is drawn last. Only the arms in
    ``mark`` that fall below ``baseline`` get a crossover line and one label each (see
    :func:`crossovers`), stacked so they never overlap.
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
        marked = [(a, c) for a, c in crossovers(df, baseline).items() if a in mark and c]
        for k, (arm, c) in enumerate(marked):
            # on a log axis a shape takes data coordinates but an annotation takes log10
            fig.add_vline(x=c, line=dict(color=arm_style(arm)["color"], dash="dash"),
                          row=1, col=1)
            right = math.log10(c) > (lo + hi) / 2  # label on the side with room
            fig.add_annotation(x=math.log10(c), y=0.04 + 0.09 * k, yref="y domain", xref="x",
                               text=f" {arm}: crossover ≈ {c:.1f} ", showarrow=False,
                               xanchor="right" if right else "left", yanchor="bottom",
                               bgcolor="rgba(255,255,255,0.85)",
                               font=dict(color=arm_style(arm)["color"], size=11))
    top = float(df["tok_s"].max()) if len(df) else 1.0
    # an interval from 2-3 noisy repeats can reach far above every mean: keep the means readable
    fig.update_yaxes(title="tok/s", range=[0, 1.3 * top], row=1, col=1)
    fig.update_yaxes(title="ms (log)", type="log", dtick="D2", row=1, col=2)
    fig.update_yaxes(title="ms (log)", type="log", dtick="D2", row=1, col=3)
    return dress(fig, "Throughput and latency vs concurrency", width, height,
                 legend=dict(orientation="h", y=-0.22, x=0), margin=dict(l=60, r=20, t=70,
                                                                         b=100))


def speedup_vs_batch(df: pd.DataFrame, value: str = "vs_baseline", baseline: str = "baseline",
                     width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Speedup over the baseline against concurrency, one line per arm, with confidence
    intervals: ``df`` has arm, concurrency, ``<value>`` (mean over repeats) and optionally
    ``<value>_lo``/``<value>_hi`` (e.g. ``bench.sanity.ci_columns``) and ``n`` (repeats, in the
    hover) and ``flags`` (sanity codes; a flagged point is drawn as an open ⚠ marker). The
    baseline is the dashed 1.0× line."""
    require(df, ("arm", "concurrency", value), "speedup_vs_batch")
    fig = go.Figure()
    arms = [a for a in dict.fromkeys(df["arm"]) if a != baseline]
    for i, arm in enumerate(arms):
        st = arm_style(str(arm), i)
        g = df[df["arm"] == arm].sort_values("concurrency")
        err = None
        if {f"{value}_lo", f"{value}_hi"} <= set(g.columns):
            err = dict(type="data", symmetric=False,
                       array=(g[f"{value}_hi"] - g[value]).tolist(),
                       arrayminus=(g[value] - g[f"{value}_lo"]).tolist(), color=st["color"],
                       thickness=1.5, width=5)
        flagged = (g["flags"].astype(str) != "").tolist() if "flags" in g else [False] * len(g)
        n = g["n"].tolist() if "n" in g else [1] * len(g)
        codes = g["flags"].astype(str).replace("", "none").tolist() if "flags" in g else \
            ["none"] * len(g)
        fig.add_trace(go.Scatter(
            x=g["concurrency"], y=g[value], mode="lines+markers", name=str(arm), error_y=err,
            line=dict(color=st["color"], width=st["width"], dash=st["dash"]),
            marker=dict(size=[12 if f else 8 for f in flagged],
                        symbol=["circle-open" if f else "circle" for f in flagged]),
            customdata=list(zip(n, codes, strict=True)),
            hovertemplate="c=%{x}: %{y:.3f}× (n=%{customdata[0]})<br>flags: %{customdata[1]}"
                          "<extra>" + html.escape(str(arm)) + "</extra>"))
    fig.add_hline(y=1.0, line=dict(color="#111111", dash="dash"),
                  annotation_text="baseline", annotation_position="bottom right")
    fig.update_xaxes(title="concurrent requests", type="log", dtick=math.log10(2))
    top = float(df[value].max()) if len(df) else 1.0
    fig.update_yaxes(title="tok/s ÷ baseline's (95 % CI over repeats)",
                     range=[0, max(2.0, 1.4 * top)])  # wide intervals run off the top
    return dress(fig, "Speedup vs batch size (mean and 95 % interval over repeats; open "
                      "marker = sanity flag)", width, height)


def latency_cdf(samples: pd.DataFrame, metric: str, by: str = "arm",
                dash_by: str | None = None, log_x: bool = True, width: int = WIDTH,
                height: int = 400) -> go.Figure:
    """Empirical CDF of one latency ``metric`` (a column in ms, e.g. ``ttft_ms``) from a table
    of samples (one row per token gap or request), one line per group of ``by`` (coloured as
    :func:`arm_style`) and, given ``dash_by`` (e.g. ``concurrency``), per value of it (one dash
    each); p50 and p99 of each line in its legend entry and as × markers. x is log scale by
    default (latencies span decades between a plain step and a queued first token)."""
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
            p50, p99 = float(np.percentile(xs, 50)), float(np.percentile(xs, 99))
            label = f"{key}" + (f" · {dash_by}={dv}" if dash_by else "")
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines", name=f"{label}: p50 {p50:.1f} · p99 {p99:.1f} ms",
                legendgroup=label, line=dict(color=st["color"], width=2.5, shape="hv",
                                             dash=styles[j % len(styles)]),
                hovertemplate="%{x:.1f} ms: %{y:.1%}<extra>" + html.escape(label) +
                              "</extra>"))
            fig.add_trace(go.Scatter(x=[p50, p99], y=[0.5, 0.99], mode="markers",
                                     name=f"{label} p50/p99", legendgroup=label,
                                     showlegend=False,
                                     marker=dict(color=st["color"], size=9, symbol="x")))
    name = metric.removesuffix("_ms").upper()
    fig.update_xaxes(title=f"{name} (ms" + (", log)" if log_x else ")"),
                     type="log" if log_x else "linear")
    fig.update_yaxes(title="share of samples ≤ x", range=[0, 1.02], tickformat=".0%")
    return dress(fig, f"{name} distribution (CDF; × = p50, p99)", width, height)
