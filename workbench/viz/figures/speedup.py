"""Benchmark tables as speedups: heatmaps over the tree shape (S × K × N), per-arm speedup and
τ bars, and speedup by target shape at a posed τ."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.viz.figures.style import (
    FLAG_MARK,
    HEIGHT,
    NEUTRAL,
    PLAIN,
    SHORT,
    TARGET,
    WIDTH,
    dress,
    interval_color,
    label,
    require,
)

if TYPE_CHECKING:
    import pandas as pd


def _ratio_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Colour-bar ticks for a log2-coloured ratio: the powers of two (and 1.5×) in range."""
    cands = [0.125, 0.25, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0]
    vals = [c for c in cands if lo - 1e-9 <= math.log2(c) <= hi + 1e-9] or [1.0]
    return [math.log2(v) for v in vals], [f"{v:g}×" for v in vals]


def speedup_heatmap(df: pd.DataFrame, x: str, y: str, value: str, facet: str | None = None,
                    zmid: float | None = 1.0, fmt: str = ".2f", flag: str | None = None,
                    lo: str | None = None, hi: str | None = None,
                    width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Heatmap of ``value`` over ``x`` × ``y`` (mean of duplicates), one panel per ``facet``.

    E.g. ``speedup_heatmap(df, x="topk", y="num_draft_tokens", value="speedup",
    facet="num_steps")`` over S × K × N. Missing cells stay blank. With ``zmid`` (a ratio such
    as a speedup, centred on 1.0) the colour is log2(value / zmid) on a diverging scale
    symmetric in log space (0.5× and 2× equally far from 1×; a ratio cannot go below 0, so
    the colour bar is labelled in ×, never negative); ``None``: a sequential scale on the raw
    value. ``flag`` names a column of sanity flags (comma-separated codes, "" when clean): a
    flagged cell shows ⚠ after its value and the codes on hover. ``lo``/``hi`` name interval
    columns (with ``zmid``): a cell is coloured only when its interval lies wholly on one side
    of ``zmid``; a cell whose interval straddles it gets the neutral middle of the scale and its
    interval in the text (without them, the title says the colour is the point estimate's).
    One ``go.Heatmap`` per panel;
    cell text = the value. Axis and panel titles come from :data:`LABELS`.
    """
    require(df, [x, y, value] + ([facet] if facet else []) + ([flag] if flag else []) +
            ([lo, hi] if lo and hi else []), "speedup_heatmap")
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
        zlo, zhi = -span, span
    else:
        zlo, zhi = float(vals.min()), float(vals.max())
    xs = sorted(df[x].unique())
    ys = sorted(df[y].unique())
    for i, (_, g) in enumerate(panels):
        grid = g.pivot_table(index=y, columns=x, values=value, aggfunc="mean")
        grid = grid.reindex(index=ys, columns=xs)
        raw = [[None if v != v else float(v) for v in row] for row in grid.to_numpy()]
        flags = [["" for _ in xs] for _ in ys]
        bands: list[list[tuple[float, float] | None]] = [[None for _ in xs] for _ in ys]
        if lo and hi:
            for r in g.itertuples():
                bands[ys.index(getattr(r, y))][xs.index(getattr(r, x))] = (
                    float(getattr(r, lo)), float(getattr(r, hi)))
        if flag:
            for r in g.itertuples():
                codes = str(getattr(r, flag) or "")
                if codes:
                    fi, fj = ys.index(getattr(r, y)), xs.index(getattr(r, x))
                    flags[fi][fj] = ",".join(filter(None, [flags[fi][fj], codes]))
        def zval(v: float | None, band: tuple[float, float] | None) -> float | None:
            if v is None or zmid is None:
                return v
            if lo and hi and interval_color(band[0] if band else None,
                                           band[1] if band else None, zmid) == NEUTRAL:
                return 0.0  # straddles zmid: the neutral middle of the scale
            return math.log2(v / zmid)

        z = [[zval(v, b) for v, b in zip(row, brow, strict=True)]
             for row, brow in zip(raw, bands, strict=True)]

        def cell(v: float | None, f: str, b: tuple[float, float] | None) -> str:
            if v is None:
                return ""
            t = format(v, fmt) + ("×" if zmid is not None else "")
            if b is not None and b[0] == b[0]:
                t += f"<br>[{format(b[0], fmt)}–{format(b[1], fmt)}]"
            return t + (f" {FLAG_MARK}" if f else "")

        text = [[cell(v, f, b) for v, f, b in zip(row, frow, brow, strict=True)]
                for row, frow, brow in zip(raw, flags, bands, strict=True)]
        custom = [[[("" if v is None else format(v, fmt)), f or "none"]
                   for v, f in zip(row, frow, strict=True)] for row, frow in zip(raw, flags,
                                                                                  strict=True)]
        bar: dict[str, Any] = dict(title=label(value))
        if zmid is not None:
            tv, tt = _ratio_ticks(zlo + math.log2(zmid), zhi + math.log2(zmid))
            bar.update(tickvals=[v - math.log2(zmid) for v in tv], ticktext=tt)
        fig.add_trace(go.Heatmap(z=z, x=[str(v) for v in xs], y=[str(v) for v in ys], text=text,
                                 texttemplate="%{text}", zmin=zlo, zmax=zhi, customdata=custom,
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
    if zmid is not None:
        title += ("<br><sup>coloured only where the 95 % interval is wholly above or below "
                  f"{zmid:g}×; white: not resolved at this noise</sup>" if lo and hi else
                  "<br><sup>colour = point estimate (no intervals given)</sup>")
    return dress(fig, title, width, height)


def speedup_bars(summary: pd.DataFrame, width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Per arm of ``run_spec_bench(...).summary`` (columns arm, speedup, tau; optional
    ``speedup_lo``/``speedup_hi`` for error bars, ``n`` and ``flags``): two panels side by side,
    each with its own axis — left the tok/s ratio to the baseline (trace ``speedup``), right τ
    per arm (trace ``τ``). A bar's colour comes from its interval, not its point: green only
    when the whole interval is above 1×, red only when below, neutral grey when it straddles
    1× or is missing (the baseline: dark grey); its label is the value with its interval.
    Flagged rows (``flags`` non-empty) carry ⚠ and their codes on the figure itself."""
    require(summary, ("arm", "speedup", "tau"), "speedup_bars")
    has_ci = {"speedup_lo", "speedup_hi"} <= set(summary.columns)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, column_widths=[0.6, 0.4],
                        subplot_titles=("speedup (tok/s ÷ baseline's)",
                                        "τ (tokens per verify step)"))
    los = summary["speedup_lo"].tolist() if has_ci else [None] * len(summary)
    his = summary["speedup_hi"].tolist() if has_ci else [None] * len(summary)
    colors = [PLAIN if a == "baseline" else interval_color(lo, hi)
              for a, lo, hi in zip(summary["arm"], los, his, strict=True)]
    flags = summary["flags"].fillna("").astype(str).tolist() if "flags" in summary else \
        [""] * len(summary)
    ns = summary["n"].tolist() if "n" in summary else [None] * len(summary)
    # a flag every row carries (a loaded machine, provisional engine choices) is said once in
    # the subtitle, not repeated over every bar where the labels would run into each other
    run_wide = flags[0] if len(flags) > 1 and flags[0] and len(set(flags)) == 1 else ""
    text = []
    for a, v, lo, hi, f, n in zip(summary["arm"], summary["speedup"], los, his, flags, ns,
                                  strict=True):
        t = "1×" if a == "baseline" else f"{v:.2f}×" + (
            f"<br>[{lo:.2f}–{hi:.2f}]" if lo is not None and lo == lo else "") + (
            f"<br>n = {n}" if n is not None else "")
        text.append(t + (f"<br>{FLAG_MARK} {f}" if f and not run_wide else ""))
    err = None
    if has_ci:
        err = dict(type="data", symmetric=False,
                   array=(summary["speedup_hi"] - summary["speedup"]).fillna(0).tolist(),
                   arrayminus=(summary["speedup"] - summary["speedup_lo"]).fillna(0).tolist(),
                   color="#333333")
    fig.add_trace(go.Bar(x=summary["arm"], y=summary["speedup"], name="speedup",
                         marker_color=colors, text=text, textposition="none",
                         cliponaxis=False, error_y=err,
                         showlegend=False,
                         marker_line=dict(color=["#8a4b00" if f else "rgba(0,0,0,0)"
                                                 for f in flags], width=2),
                         hovertemplate="%{x}: %{y:.3f}×<extra></extra>"), row=1, col=1)
    # each label sits above its bar's error bar (text placed "outside" would sit on the bar's
    # end, under the whisker); the 1× line is named in the axis title, not over the bars
    for a, v, hi, t in zip(summary["arm"], summary["speedup"], his, text, strict=True):
        y = max(float(v), float(hi)) if hi is not None and hi == hi else float(v)
        fig.add_annotation(x=a, y=y, text=t, showarrow=False, yanchor="bottom", yshift=2,
                           font=dict(size=11), row=1, col=1)
    fig.add_hline(y=1.0, line=dict(color="#555555", dash="dash"), row=1, col=1)
    fig.add_trace(go.Bar(x=summary["arm"], y=summary["tau"], name="τ", marker_color=TARGET,
                         text=[f"{v:.2f}" for v in summary["tau"]], textposition="outside",
                         showlegend=False, hovertemplate="%{x}: τ %{y:.2f}<extra></extra>"),
                  row=1, col=2)
    top = float((summary["speedup_hi"].fillna(summary["speedup"]) if has_ci
                 else summary["speedup"]).max())
    lines = max(t.count("<br>") + 1 for t in text) if text else 1
    fig.update_yaxes(title="× baseline tok/s (dashed: 1× = baseline)",
                     range=[0, max(1.2, top * (1.15 + 0.1 * lines))], row=1, col=1)
    fig.update_yaxes(title="τ", range=[0, float(summary["tau"].max()) * 1.2 + 0.1], row=1,
                     col=2)
    fig.update_xaxes(title="arm")
    title = "EAGLE-3 vs baseline: speedup and accept length"
    legend = ("green/red: the whole 95 % interval above/below 1×; grey: straddles 1×"
              if has_ci else "no intervals: bars grey (a point alone claims no side)")
    if run_wide:
        legend += f" · {FLAG_MARK} every row: {run_wide}"
    elif any(flags):
        legend += f" · {FLAG_MARK} sanity flag ({sum(bool(f) for f in flags)} rows)"
    return dress(fig, f"{title}<br><sup>{legend}</sup>", width, height + 40,
                 showlegend=False, margin=dict(l=60, r=30, t=90, b=50))


def shape_speedups(df: pd.DataFrame, width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Per row of ``workbench.bench.shapes.run_shapes`` (columns shape, speedup, bound,
    verify_ratio; optional ``speedup_lo``/``speedup_hi``, ``flags``). Left panel: measured
    speedup (bars, trace ``speedup``, coloured by its interval as :func:`speedup_bars`) and
    the bound with drafting free, τ / verify_ratio (markers, trace ``bound: free drafting``).
    Right panel, its own axis: what verifying N tokens costs in plain steps (trace ``verify /
    plain step``). Flagged rows (e.g. ``trained_vs_random``) carry ⚠ and their codes on the
    figure."""
    require(df, ("shape", "speedup", "bound", "verify_ratio"), "shape_speedups")
    has_ci = {"speedup_lo", "speedup_hi"} <= set(df.columns)
    los = df["speedup_lo"].tolist() if has_ci else [None] * len(df)
    his = df["speedup_hi"].tolist() if has_ci else [None] * len(df)
    flags = df["flags"].fillna("").astype(str).tolist() if "flags" in df else [""] * len(df)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, column_widths=[0.62, 0.38],
                        subplot_titles=("speedup at the posed τ", "verify step ÷ plain step"))
    text = [f"{v:.2f}×" + (f"<br>[{lo:.2f}–{hi:.2f}]" if lo is not None and lo == lo else "")
            + (f"<br>{FLAG_MARK} {f}" if f else "")
            for v, lo, hi, f in zip(df["speedup"], los, his, flags, strict=True)]
    err = None
    if has_ci:
        err = dict(type="data", symmetric=False,
                   array=(df["speedup_hi"] - df["speedup"]).fillna(0).tolist(),
                   arrayminus=(df["speedup"] - df["speedup_lo"]).fillna(0).tolist(),
                   color="#333333")
    fig.add_trace(go.Bar(x=df["shape"], y=df["speedup"], name="speedup",
                         marker_color=[interval_color(lo, hi) for lo, hi in zip(los, his,
                                                                               strict=True)],
                         marker_line=dict(color=["#8a4b00" if f else "rgba(0,0,0,0)"
                                                 for f in flags], width=2),
                         text=text, textposition="outside", cliponaxis=False, error_y=err),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=df["shape"], y=df["bound"], name="bound: free drafting",
                             mode="markers", marker=dict(symbol="line-ew-open", size=28,
                                                         color="#d62728", line=dict(width=3))),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=df["shape"], y=df["verify_ratio"], name="verify / plain step",
                         marker_color=TARGET, text=[f"{v:.2f}" for v in df["verify_ratio"]],
                         textposition="outside"), row=1, col=2)
    top = float(max(df["bound"].max(), df["speedup"].max(),
                    df["speedup_hi"].max() if has_ci else 0))
    fig.update_yaxes(title="tok/s ÷ baseline's", range=[0, top * 1.3], row=1, col=1)
    fig.update_yaxes(title="plain steps per verify", range=[0, float(df["verify_ratio"].max())
                                                             * 1.2], row=1, col=2)
    fig.update_xaxes(title="target shape (layers × width)")
    note = ("bars green/red only when the 95 % interval is wholly above/below 1×" if has_ci
            else "no intervals (one run): bars grey, a point alone claims no side")
    if any(flags):
        note += f" · {FLAG_MARK} sanity flag"
    return dress(fig, f"Speedup at a fixed accept length, by target shape<br><sup>{note}"
                      "</sup>", width, height + 80, legend=dict(orientation="h", y=-0.45, x=0),
                 margin=dict(l=60, r=30, t=90, b=140))
