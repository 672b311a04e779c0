"""Where time goes: milliseconds per step and phase, the speculation policy over time, engine
init stages, and what switching speculation off and on costs (warm vs cold draft)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.trace.frame import TIMING_PHASES
from workbench.viz.figures.style import (
    ACCEPTED,
    FLAG_MARK,
    HEIGHT,
    PHASE_COLORS,
    PLAIN,
    SPEC,
    WIDTH,
    dress,
    require,
)

if TYPE_CHECKING:
    import pandas as pd


def phase_timeline(timing_df: pd.DataFrame, width: int = WIDTH,
                   height: int = HEIGHT) -> go.Figure:
    """Stacked milliseconds per step and phase (one bar trace per phase, DESIGN.md §4 order).

    Accepts ``frame("timing")`` (wide) or ``frame("timing_long")``. Plain steps book their
    decode forward under ``decode``, prefill chunks run in a step under ``prefill``.
    """
    if "phase" in timing_df.columns:
        require(timing_df, ("step", "phase", "ms", "mode"), "phase_timeline")
        wide = timing_df.pivot_table(index=["step", "mode"], columns="phase", values="ms",
                                     aggfunc="sum").reset_index()
    else:
        require(timing_df, ("step", "mode", *(f"{p}_ms" for p in TIMING_PHASES)),
                "phase_timeline")
        wide = timing_df.rename(columns={f"{p}_ms": p for p in TIMING_PHASES})
    wide = wide.sort_values("step")
    fig = go.Figure()
    for p in TIMING_PHASES:
        if p not in wide.columns:
            continue
        fig.add_trace(go.Bar(x=wide["step"], y=wide[p],
                             name=p, marker_color=PHASE_COLORS[p], customdata=wide["mode"],
                             hovertemplate="step %{x} (%{customdata})<br>" + p +
                                           " %{y:.2f} ms<extra></extra>"))
    fig.update_xaxes(title="engine step")
    fig.update_yaxes(title="milliseconds")
    return dress(fig, "Where a step's time goes", width, height, barmode="stack", bargap=0.1)


def phase_breakdown(timing_df: pd.DataFrame, width: int = WIDTH,
                    height: int = 320) -> go.Figure:
    """Mean ms per step and phase (``frame("timing")``), speculative vs plain steps, as one
    stacked horizontal bar per mode (trace per phase, DESIGN.md §4 order): where a step's time
    goes on average — draft, verify, accept, commit. The title gives the step counts."""
    require(timing_df, ("mode", *(f"{p}_ms" for p in TIMING_PHASES)), "phase_breakdown")
    means = timing_df.groupby("mode")[[f"{p}_ms" for p in TIMING_PHASES]].mean()
    counts = timing_df.groupby("mode").size()
    modes = list(means.index)
    fig = go.Figure()
    for p in TIMING_PHASES:
        ys = means[f"{p}_ms"].tolist()
        fig.add_trace(go.Bar(y=[f"{m} ({counts[m]} steps)" for m in modes], x=ys,
                             orientation="h", name=p, marker_color=PHASE_COLORS[p],
                             text=[f"{v:.1f}" if v >= 0.05 * max(means.sum(axis=1)) else ""
                                   for v in ys], textposition="inside",
                             hovertemplate="%{y}: " + p + " %{x:.2f} ms<extra></extra>"))
    fig.update_xaxes(title="mean ms per step")
    return dress(fig, "Where a step's time goes, on average", width, height,
                 barmode="stack", legend=dict(orientation="h", y=-0.35, x=0),
                 margin=dict(l=160, r=30, t=60, b=90))


def policy_timeline(policy_df: pd.DataFrame, threshold: int | None = None, width: int = WIDTH,
                    height: int = 520) -> go.Figure:
    """Per step: the decode batch and whether the policy speculated (``frame("policy")``).

    Row 1: ``decode batch`` line, ``speculate`` / ``plain`` markers, optional threshold line.
    Row 2: measured step time, bars ``spec step ms`` / ``plain step ms``.
    """
    require(policy_df, ("step", "decode_batch", "speculate", "measured_ms"), "policy_timeline")
    df = policy_df.sort_values("step")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.6, 0.4],
                        vertical_spacing=0.08)
    fig.add_trace(go.Scatter(x=df["step"], y=df["decode_batch"], mode="lines",
                             line=dict(color="#bbbbbb", shape="hv"), name="decode batch"),
                  row=1, col=1)
    for name, flag, color in (("speculate", True, SPEC), ("plain", False, PLAIN)):
        sel = df[df["speculate"] == flag]
        fig.add_trace(go.Scatter(x=sel["step"], y=sel["decode_batch"], mode="markers",
                                 marker=dict(color=color, size=7), name=name,
                                 customdata=sel["reason"] if "reason" in sel else None,
                                 hovertemplate="step %{x}, batch %{y}<br>%{customdata}"
                                               "<extra>" + name + "</extra>"), row=1, col=1)
        fig.add_trace(go.Bar(x=sel["step"], y=sel["measured_ms"], marker_color=color,
                             name=f"{'spec' if flag else 'plain'} step ms", showlegend=True),
                      row=2, col=1)
    if threshold is not None:
        fig.add_hline(y=threshold + 0.5, line=dict(color="#d62728", dash="dash"), row=1, col=1,
                      annotation_text=f"threshold {threshold}: speculate while batch ≤ "
                                      f"{threshold}", annotation_position="top left")
    fig.update_yaxes(title="decode batch", row=1, col=1, rangemode="tozero")
    fig.update_yaxes(title="step ms", row=2, col=1)
    fig.update_xaxes(title="engine step", row=2, col=1)
    return dress(fig, "Speculation policy over time", width, height, bargap=0.05)


def init_stages(init_df: pd.DataFrame, width: int = WIDTH, height: int = 380) -> go.Figure:
    """Engine init stages (``frame("init")``) as horizontal bars coloured by status.

    One bar trace per status present (``ok``, ``fallback``, ``failed``); the bar length is the
    stage's seconds (at least a sliver so a stage that failed at once still shows).
    """
    require(init_df, ("stage", "status", "seconds"), "init_stages")
    colors = {"ok": ACCEPTED, "fallback": "#ff7f0e", "failed": "#d62728"}
    fig = go.Figure()
    longest = float(init_df["seconds"].max()) if len(init_df) else 1.0
    for status in ("ok", "fallback", "failed"):
        sel = init_df[init_df["status"] == status]
        if sel.empty:
            continue
        detail = sel["detail"] if "detail" in sel else [""] * len(sel)
        fig.add_trace(go.Bar(y=sel["stage"], x=[max(s, longest * 0.02) for s in sel["seconds"]],
                             orientation="h", name=status, marker_color=colors[status],
                             customdata=list(detail),
                             hovertemplate="%{y}: %{x:.3f} s<br>%{customdata}<extra>" + status +
                                           "</extra>"))
    fig.update_yaxes(title="stage", categoryorder="array",
                     categoryarray=list(reversed(init_df["stage"].tolist())))
    fig.update_xaxes(title="seconds")
    return dress(fig, "Engine init, stage by stage", width, height)


def warm_vs_cold(switch_df: pd.DataFrame, width: int = WIDTH,
                 height: int = HEIGHT) -> go.Figure:
    """What turning speculation off and on costs, warm vs cold draft, per concurrency, from
    ``workbench.bench.concurrency.switch_costs`` (columns concurrency, warm_switch_extra_ms,
    cold_switch_extra_ms, warm_plain_ms, cold_plain_ms).

    Left: extra ms of a speculative step right after an off step (cold pays the draft
    catch-up there). Right: ms of a plain step (warm pays a draft extend on every one).
    Traces ``warm draft`` / ``cold draft`` in each panel (``meta`` = ``switch`` / ``plain``).
    Every bar is labelled with its value; a switch cost below zero (a step after a switch
    cannot be cheaper than one without: the difference is noise) carries ⚠ on the figure and
    the title counts them. ``n`` columns (``<state>_switches``), when present, are shown.
    """
    require(switch_df, ("concurrency", "warm_switch_extra_ms", "cold_switch_extra_ms",
                        "warm_plain_ms", "cold_plain_ms"), "warm_vs_cold")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("extra ms when speculation switches on",
                                        "ms of a plain step"))
    xs = [str(c) for c in switch_df["concurrency"]]
    negative = 0
    for col, what in ((1, "switch"), (2, "plain")):
        for state, color in (("warm", "#ff7f0e"), ("cold", "#1f77b4")):
            key = f"{state}_switch_extra_ms" if what == "switch" else f"{state}_plain_ms"
            vals = switch_df[key].astype(float).tolist()
            ns = switch_df[f"{state}_switches"].tolist() if what == "switch" and \
                f"{state}_switches" in switch_df else [None] * len(vals)
            text = [f"{v:.1f}" + (f" (n={k})" if k is not None else "") +
                    (f" {FLAG_MARK} < 0: noise" if what == "switch" and v < 0 else "")
                    for v, k in zip(vals, ns, strict=True)]
            negative += sum(1 for v in vals if what == "switch" and v < 0)
            fig.add_trace(go.Bar(x=xs, y=vals, name=f"{state} draft", text=text,
                                 textposition="outside", cliponaxis=False,
                                 constraintext="none",
                                 marker_color=color, legendgroup=state, meta=what,
                                 marker_line=dict(color=["#8a4b00" if what == "switch" and v < 0
                                                         else "rgba(0,0,0,0)" for v in vals],
                                                  width=2),
                                 showlegend=col == 1), row=1, col=col)
    fig.update_xaxes(title="concurrent requests", type="category")
    fig.update_yaxes(title="ms", row=1, col=1)
    fig.update_yaxes(title="ms", rangemode="tozero", row=1, col=2)
    title = "Warm vs cold draft: pay on every plain step, or once per switch"
    if negative:
        title += (f"<br><sup>{FLAG_MARK} {negative} switch cost(s) below 0 ms: noise larger "
                  "than the cost, not a saving</sup>")
    return dress(fig, title, width, height + (30 if negative else 0), barmode="group")
