"""Benchmark tables as speedups: heatmaps over the tree shape (S × K × N), per-arm speedup and
τ bars, and speedup by target shape at a posed τ."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.viz.figures.style import (
    ACCEPTED,
    FLAG_MARK,
    HEIGHT,
    PLAIN,
    SHORT,
    TARGET,
    WIDTH,
    dress,
    label,
    require,
)

if TYPE_CHECKING:
    import pandas as pd


def _ratio_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Colour-bar ticks for a log2-coloured ratio: the powers of two (and 1.5×) in range."""
    cands = [0.125, 0.25, 0.5, 0.67, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0]
    vals = [c for c in cands if lo - 1e-9 <= math.log2(c) <= hi + 1e-9] or [1.0]
    return [math.log2(v) for v in vals], [f"{v:g}×" for v in vals]


def speedup_heatmap(df: pd.DataFrame, x: str, y: str, value: str, facet: str | None = None,
                    zmid: float | None = 1.0, fmt: str = ".2f", flag: str | None = None,
                    width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Heatmap of ``value`` over ``x`` × ``y`` (mean of duplicates), one panel per ``facet``.

    E.g. ``speedup_heatmap(df, x="topk", y="num_draft_tokens", value="speedup",
    facet="num_steps")`` over S × K × N. Missing cells stay blank. With ``zmid`` (a ratio such
    as a speedup, centred on 1.0) the colour is log2(value / zmid) on a diverging scale
    symmetric in log space (0.5× and 2× equally far from 1×; a ratio cannot go below 0, so
    the colour bar is labelled in ×, never negative); ``None``: a sequential scale on the raw
    value. ``flag`` names a column of sanity flags (comma-separated codes, "" when clean): a
    flagged cell shows ⚠ after its value and the codes on hover. One ``go.Heatmap`` per panel;
    cell text = the value. Axis and panel titles come from :data:`LABELS`.
    """
    require(df, [x, y, value] + ([facet] if facet else []) + ([flag] if flag else []),
            "speedup_heatmap")
    panels = [(None, df)] if facet is None else [(k, g) for k, g in df.groupby(facet)]
    short = SHORT.get(facet or "", label(facet or ""))
    fig = make_subplots(rows=1, cols=len(panels), shared_yaxes=True,
                        subplot_titles=[f"{short} = {k}" for k, _ in panels] if facet else None,
                        horizontal_spacing=0.04)
    vals = df[value].astype(float)
    if zmid is not None:
        if (vals <= 0).any():
            raise ValueError(f"speedup_heatmap: {value} must be > 0 for a ratio scale")
        logs = [math.log2(v / zmid) for v in vals]
        span = max(max(abs(v) for v in logs), 0.05)
        lo, hi = -span, span
    else:
        lo, hi = float(vals.min()), float(vals.max())
    xs = sorted(df[x].unique())
    ys = sorted(df[y].unique())
    for i, (_, g) in enumerate(panels):
        grid = g.pivot_table(index=y, columns=x, values=value, aggfunc="mean")
        grid = grid.reindex(index=ys, columns=xs)
        raw = [[None if v != v else float(v) for v in row] for row in grid.to_numpy()]
        flags = [["" for _ in xs] for _ in ys]
        if flag:
            for r in g.itertuples():
                codes = str(getattr(r, flag) or "")
                if codes:
                    fi, fj = ys.index(getattr(r, y)), xs.index(getattr(r, x))
                    flags[fi][fj] = ",".join(filter(None, [flags[fi][fj], codes]))
        z = raw if zmid is None else [[None if v is None else math.log2(v / zmid) for v in row]
                                      for row in raw]
        text = [["" if v is None else format(v, fmt) + ("×" if zmid is not None else "") +
                 (f" {FLAG_MARK}" if f else "") for v, f in zip(row, frow, strict=True)]
                for row, frow in zip(raw, flags, strict=True)]
        custom = [[[("" if v is None else format(v, fmt)), f or "none"]
                   for v, f in zip(row, frow, strict=True)] for row, frow in zip(raw, flags,
                                                                                  strict=True)]
        bar = dict(title=label(value))
        if zmid is not None:
            tv, tt = _ratio_ticks(lo + math.log2(zmid), hi + math.log2(zmid))
            bar.update(tickvals=[v - math.log2(zmid) for v in tv], ticktext=tt)
        fig.add_trace(go.Heatmap(z=z, x=[str(v) for v in xs], y=[str(v) for v in ys], text=text,
                                 texttemplate="%{text}", zmin=lo, zmax=hi, customdata=custom,
                                 colorscale="RdBu" if zmid is not None else "Viridis",
                                 showscale=i == 0, colorbar=bar,
                                 hovertemplate=f"{SHORT.get(x, x)} %{{x}}, {SHORT.get(y, y)} "
                                               f"%{{y}}<br>{label(value)} %{{customdata[0]}}"
                                               "<br>flags: %{customdata[1]}<extra></extra>"),
                      row=1, col=i + 1)
        fig.update_xaxes(title=label(x), type="category", row=1, col=i + 1)
    fig.update_yaxes(title=label(y), type="category", row=1, col=1)
    title = f"{label(value)} over {SHORT.get(x, x)} × {SHORT.get(y, y)}" + \
        (f" × {SHORT.get(facet, facet)}" if facet else "")
    if flag and (df[flag].astype(str) != "").any():
        title += f" · {FLAG_MARK} = sanity flag (hover)"
    return dress(fig, title, width, height)


def speedup_bars(summary: pd.DataFrame, width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Per arm of ``run_spec_bench(...).summary`` (columns arm, speedup, tau; optional
    ``speedup_lo``/``speedup_hi`` for error bars): two panels side by side, each with its own
    axis — left the tok/s ratio to the baseline (trace ``speedup``; green faster, red slower,
    grey the baseline; dashed line at 1.0×), right τ per arm (trace ``τ``)."""
    require(summary, ("arm", "speedup", "tau"), "speedup_bars")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, column_widths=[0.6, 0.4],
                        subplot_titles=("speedup (tok/s ÷ baseline's)",
                                        "τ (tokens per verify step)"))
    colors = [PLAIN if a == "baseline" else ACCEPTED if s >= 1 else "#d62728"
              for a, s in zip(summary["arm"], summary["speedup"], strict=True)]
    err = None
    if {"speedup_lo", "speedup_hi"} <= set(summary.columns):
        err = dict(type="data", symmetric=False,
                   array=(summary["speedup_hi"] - summary["speedup"]).tolist(),
                   arrayminus=(summary["speedup"] - summary["speedup_lo"]).tolist(),
                   color="#333333")
    fig.add_trace(go.Bar(x=summary["arm"], y=summary["speedup"], name="speedup",
                         marker_color=colors, text=[f"{v:.2f}×" for v in summary["speedup"]],
                         textposition="inside", insidetextanchor="end", error_y=err,
                         showlegend=False,
                         hovertemplate="%{x}: %{y:.3f}×<extra></extra>"), row=1, col=1)
    fig.add_hline(y=1.0, line=dict(color="#555555", dash="dash"), row=1, col=1,
                  annotation_text="1.0× = baseline", annotation_position="top right")
    fig.add_trace(go.Bar(x=summary["arm"], y=summary["tau"], name="τ", marker_color=TARGET,
                         text=[f"{v:.2f}" for v in summary["tau"]], textposition="outside",
                         showlegend=False, hovertemplate="%{x}: τ %{y:.2f}<extra></extra>"),
                  row=1, col=2)
    top = float((summary["speedup_hi"] if err else summary["speedup"]).max())
    fig.update_yaxes(title="× baseline tok/s", range=[0, max(1.2, top * 1.2)], row=1, col=1)
    fig.update_yaxes(title="τ", range=[0, float(summary["tau"].max()) * 1.2 + 0.1], row=1,
                     col=2)
    fig.update_xaxes(title="arm")
    return dress(fig, "EAGLE-3 vs baseline: speedup and accept length", width, height,
                 showlegend=False)


def shape_speedups(df: pd.DataFrame, width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Per row of ``workbench.bench.shapes.run_shapes`` (columns shape, speedup, bound,
    verify_ratio). Left panel: measured speedup (bars, trace ``speedup``) and the bound with
    drafting free, τ / verify_ratio (markers, trace ``bound: free drafting``). Right panel,
    its own axis: what verifying N tokens costs in plain steps (trace ``verify / plain
    step``)."""
    require(df, ("shape", "speedup", "bound", "verify_ratio"), "shape_speedups")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, column_widths=[0.62, 0.38],
                        subplot_titles=("speedup at the posed τ", "verify step ÷ plain step"))
    fig.add_trace(go.Bar(x=df["shape"], y=df["speedup"], name="speedup", marker_color=ACCEPTED,
                         text=[f"{v:.2f}×" for v in df["speedup"]], textposition="outside"),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=df["shape"], y=df["bound"], name="bound: free drafting",
                             mode="markers", marker=dict(symbol="line-ew-open", size=28,
                                                         color="#d62728", line=dict(width=3))),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=df["shape"], y=df["verify_ratio"], name="verify / plain step",
                         marker_color=TARGET, text=[f"{v:.2f}" for v in df["verify_ratio"]],
                         textposition="outside"), row=1, col=2)
    top = float(max(df["bound"].max(), df["speedup"].max()))
    fig.update_yaxes(title="tok/s ÷ baseline's", range=[0, top * 1.15], row=1, col=1)
    fig.update_yaxes(title="plain steps per verify", range=[0, float(df["verify_ratio"].max())
                                                             * 1.2], row=1, col=2)
    fig.update_xaxes(title="target shape (layers × width)")
    return dress(fig, "Speedup at a fixed accept length, by target shape", width,
                 height + 60, legend=dict(orientation="h", y=-0.45, x=0),
                 margin=dict(l=60, r=30, t=60, b=140))
