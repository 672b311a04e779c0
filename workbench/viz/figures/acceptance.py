"""How often drafts are accepted: by depth, by the draft's own confidence, per verify step (τ),
per draft position (α_d), and the draft-training curves that lead there."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.viz.figures.style import (
    ACCEPTED,
    ARM_COLORS,
    HEIGHT,
    REJECTED,
    WIDTH,
    dress,
    require,
)

if TYPE_CHECKING:
    import pandas as pd


def acceptance_by_depth(df: pd.DataFrame, by: str | None = None, width: int = WIDTH,
                        height: int = HEIGHT) -> go.Figure:
    """Acceptance per draft depth from ``frame("accept_by_depth")``.

    Without ``by``: bars ``node rate`` (accepted / drafted nodes at that depth) and a line
    ``trees reaching depth`` (share of verified trees whose accepted path reaches that depth).
    With ``by`` (a column such as ``arm``): one ``tree_rate`` line per group. y is in [0, 1].
    """
    require(df, ("depth", "rate", "tree_rate"), "acceptance_by_depth")
    fig = go.Figure()
    if by is None:
        fig.add_trace(go.Bar(x=df["depth"], y=df["rate"], name="node rate (accepted / drafted)",
                             marker_color=REJECTED,
                             customdata=df[["accepted", "drafted"]].to_numpy()
                             if {"accepted", "drafted"} <= set(df.columns) else None,
                             hovertemplate="depth %{x}<br>node rate %{y:.3f}"
                                           "<extra></extra>"))
        fig.add_trace(go.Scatter(x=df["depth"], y=df["tree_rate"], mode="lines+markers",
                                 name="trees reaching depth", line=dict(color=ACCEPTED, width=3),
                                 hovertemplate="depth %{x}<br>%{y:.3f} of trees<extra></extra>"))
    else:
        require(df, (by,), "acceptance_by_depth")
        for i, (key, g) in enumerate(df.groupby(by, sort=False)):
            fig.add_trace(go.Scatter(x=g["depth"], y=g["tree_rate"], mode="lines+markers",
                                     name=str(key),
                                     line=dict(color=ARM_COLORS[i % len(ARM_COLORS)])))
    fig.update_xaxes(title="draft depth", dtick=1)
    fig.update_yaxes(title="acceptance", range=[0, 1.05])
    return dress(fig, "Where drafts are rejected: acceptance by depth", width, height)


def acceptance_vs_confidence(tree_df: pd.DataFrame, bins: int = 10, width: int = WIDTH,
                             height: int = HEIGHT) -> go.Figure:
    """Acceptance of drafted nodes whose parent was accepted, binned by the draft's probability.

    A node can only be accepted if its parent was, so nodes under a rejected parent are left
    out. Traces: ``acceptance`` (line, share accepted per bin) and ``nodes`` (bars, count on
    a second axis). A calibrated draft lies on the diagonal (trace ``calibrated``).
    """
    require(tree_df, ("step", "rid", "node", "parent", "draft_prob", "accepted", "verified"),
            "acceptance_vs_confidence")
    t = tree_df[tree_df["verified"]]
    acc = {(s, r, n): a for s, r, n, a in zip(t["step"], t["rid"], t["node"], t["accepted"],
                                              strict=True)}
    parent_ok = [bool(acc.get((s, r, p), False)) for s, r, p in
                 zip(t["step"], t["rid"], t["parent"], strict=True)]
    live = t[(t["node"] > 0).to_numpy() & np.asarray(parent_ok, dtype=bool)]
    edges = [i / bins for i in range(bins + 1)]
    centers, rates, counts = [], [], []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        sel = live[(live["draft_prob"] >= lo) & ((live["draft_prob"] < hi) | (hi == 1.0))]
        centers.append((lo + hi) / 2)
        counts.append(len(sel))
        rates.append(float(sel["accepted"].mean()) if len(sel) else None)
    # Counts get their own panel below: as bars behind the line they hid the diagonal.
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.72, 0.28],
                        vertical_spacing=0.06)
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="calibrated (diagonal)",
                             line=dict(color="#555555", dash="dot")), row=1, col=1)
    fig.add_trace(go.Scatter(x=centers, y=rates, mode="lines+markers", name="acceptance",
                             customdata=counts, line=dict(color=ACCEPTED, width=3),
                             hovertemplate="draft p %{x:.2f}: %{y:.3f} accepted "
                                           "(%{customdata} nodes)<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=centers, y=counts, name="nodes", marker_color=REJECTED,
                         width=1 / bins * 0.9, showlegend=False,
                         hovertemplate="%{y} nodes<extra></extra>"), row=2, col=1)
    fig.update_xaxes(range=[0, 1], row=1, col=1)
    fig.update_xaxes(title="draft probability of the node", range=[0, 1], row=2, col=1)
    fig.update_yaxes(title="share accepted", range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(title="nodes", rangemode="tozero", tickformat="d", row=2, col=1)
    return dress(fig, "Is the draft's confidence informative? (nodes under an accepted parent)",
                 width, max(height, 480), legend=dict(orientation="h", y=1.0, x=0,
                                                      yanchor="bottom"))


def tau_histogram(verify_df: pd.DataFrame, by: str | None = None, width: int = WIDTH,
                  height: int = HEIGHT) -> go.Figure:
    """Distribution of τ (tokens per verify step, bonus included) from ``frame("verify")``.

    One bar trace per group of ``by`` (or a single trace ``τ``); y is the share of verify
    steps; the title gives each group's τ as the mean over its verify steps (a long request
    weighs more than in a mean over requests). Bars are at integers 1..max τ.
    """
    require(verify_df, ("accept_length",), "tau_histogram")
    groups = [("τ", verify_df)] if by is None else [
        (str(k), g) for k, g in verify_df.groupby(by, sort=False)]
    top = int(verify_df["accept_length"].max()) if len(verify_df) else 1
    xs = list(range(1, top + 1))
    fig = go.Figure()
    means = []
    for i, (name, g) in enumerate(groups):
        counts = g["accept_length"].value_counts()
        n = max(len(g), 1)
        fig.add_trace(go.Bar(x=xs, y=[counts.get(x, 0) / n for x in xs], name=name,
                             customdata=[int(counts.get(x, 0)) for x in xs],
                             marker_color=ARM_COLORS[(i + 2) % len(ARM_COLORS)] if by else
                             ACCEPTED,
                             hovertemplate="τ = %{x}: %{y:.1%} (%{customdata} steps)"
                                           "<extra>" + html.escape(name) + "</extra>"))
        means.append(f"{name} {g['accept_length'].mean():.2f}" if by else
                     f"{g['accept_length'].mean():.2f}")
    fig.update_xaxes(title="τ = tokens emitted per verify step (bonus included)", dtick=1,
                     range=[0.4, top + 0.6])
    fig.update_yaxes(title="share of verify steps", tickformat=".0%")
    return dress(fig, "Accept length per verify step — τ, mean over verify steps: "
                 + ", ".join(means), width, height, barmode="group")


def accept_rate_by_position(verify_df: pd.DataFrame, by: str | None = None) -> pd.DataFrame:
    """α_d per draft position from ``frame("verify")`` (one row per verify step; a step
    accepted ``accept_length - 1`` draft tokens, a prefix of the drafted path).

    Columns: [``by``,] ``position`` (1-based), ``drafts`` (verify steps), ``accepted`` (steps
    whose accepted path reached that position — vLLM's ``num_accepted_tokens_per_pos``),
    ``alpha`` = accepted / drafts (vLLM's per-position acceptance rate) and ``alpha_cond`` =
    accepted at d / accepted at d-1 (the EAGLE papers' n-α: acceptance given the previous
    token was accepted; NaN when no step reached d-1).
    """
    require(verify_df, ("accept_length",) + ((by,) if by else ()), "accept_rate_by_position")
    groups = [(None, verify_df)] if by is None else list(verify_df.groupby(by, sort=False))
    top = int(verify_df["accept_length"].max()) - 1 if len(verify_df) else 0
    rows = []
    for key, g in groups:
        acc = (g["accept_length"].to_numpy(dtype=int) - 1)
        prev = len(acc)
        for d in range(1, max(top, 0) + 1):
            n = int((acc >= d).sum())
            rows.append({**({by: key} if by else {}), "position": d, "drafts": len(acc),
                         "accepted": n, "alpha": n / len(acc) if len(acc) else math.nan,
                         "alpha_cond": n / prev if prev else math.nan})
            prev = n
    import pandas as pd

    cols = ([by] if by else []) + ["position", "drafts", "accepted", "alpha", "alpha_cond"]
    return pd.DataFrame(rows, columns=cols)


def alpha_by_position(alpha_df: pd.DataFrame, by: str | None = None, width: int = WIDTH,
                      height: int = HEIGHT) -> go.Figure:
    """α_d from :func:`accept_rate_by_position`: left panel ``alpha`` (share of verify steps
    reaching position d), right panel ``alpha_cond`` (acceptance at d given d-1 accepted),
    one line per group of ``by`` (traces ``<group> α`` and ``<group> α|prev``)."""
    require(alpha_df, ("position", "alpha", "alpha_cond"), "alpha_by_position")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("α_d: share of verify steps accepting position d",
                                        "n-α: accepted at d given d−1 accepted"))
    groups = [("all", alpha_df)] if by is None else list(alpha_df.groupby(by, sort=False))
    for i, (key, g) in enumerate(groups):
        color = ACCEPTED if by is None else ARM_COLORS[i % len(ARM_COLORS)]
        for col, what, suffix in ((1, "alpha", "α"), (2, "alpha_cond", "α|prev")):
            fig.add_trace(go.Scatter(x=g["position"], y=g[what], mode="lines+markers",
                                     name=f"{key} {suffix}", legendgroup=str(key),
                                     showlegend=col == 1, line=dict(color=color, width=2.5),
                                     customdata=g[["accepted", "drafts"]].to_numpy(),
                                     hovertemplate="position %{x}: %{y:.3f} (%{customdata[0]} "
                                                   "of %{customdata[1]} steps)<extra>" +
                                                   html.escape(str(key)) + "</extra>"),
                          row=1, col=col)
    fig.update_xaxes(title="draft position d", dtick=1)
    fig.update_yaxes(title="acceptance rate", range=[0, 1.05])
    return dress(fig, "Acceptance per draft position", width, height)


def training_curves(history: Sequence[dict[str, Any]], width: int = WIDTH,
                    height: int = HEIGHT) -> go.Figure:
    """``train_draft`` summary ``history`` (rows: step, loss, acc list per TTT step), in two
    panels with their own axes: loss (trace ``loss``, left) and the top-1 agreement of each
    unrolled step (``acc step j``, right, 0–1)."""
    if not history:
        raise ValueError("training_curves: empty history")
    steps = [h["step"] for h in history]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("training-time-test loss",
                                        "top-1 agreement with the target, per unrolled step"))
    fig.add_trace(go.Scatter(x=steps, y=[h["loss"] for h in history], name="loss",
                             mode="lines+markers", line=dict(color="#333333", width=3)),
                  row=1, col=1)
    n_acc = len(history[0].get("acc", []))
    for j in range(n_acc):
        fig.add_trace(go.Scatter(x=steps, y=[h["acc"][j] for h in history], name=f"acc step {j}",
                                 mode="lines+markers",
                                 line=dict(color=ARM_COLORS[j % len(ARM_COLORS)])), row=1, col=2)
    fig.update_xaxes(title="training step")
    fig.update_yaxes(title="loss", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="agreement", range=[0, 1], row=1, col=2)
    return dress(fig, f"Draft head training (training-time test, {len(history)} points)",
                 width, height)
