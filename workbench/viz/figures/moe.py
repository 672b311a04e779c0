"""MoE figures: expert coverage vs tokens in a forward, and the verify/decode cost ratio vs
batch (measured beside the cost model's prediction, or a box's what-if)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

from workbench.policy.moe_cost import uniform_coverage
from workbench.viz.figures.style import ARM_COLORS, HEIGHT, WIDTH, dress, require, tick_log_axis

KIND_SYMBOLS = {"prefill": "square", "decode": "circle", "verify": "diamond", "pass": "x"}


def expert_coverage(df: pd.DataFrame, gamma: float | None = None, width: int = WIDTH,
                    height: int = HEIGHT) -> go.Figure:
    """``frame("expert_coverage")`` (or ``remote.experts.read_dump``): distinct experts per MoE
    layer vs tokens in the forward, one marker per (forward, layer) by kind (trace = kind),
    beside the uniform-routing curve E·(1 − (1 − k/E)^T) (trace ``uniform routing``) and, with
    ``gamma``, the fitted curve (trace ``fitted γ``)."""
    require(df, ("kind", "tokens", "distinct", "num_experts", "top_k"), "expert_coverage")
    fig = go.Figure()
    for i, (kind, g) in enumerate(df.groupby("kind", sort=False)):
        fig.add_trace(go.Scatter(
            x=g["tokens"], y=g["distinct"], mode="markers", name=str(kind),
            marker=dict(symbol=KIND_SYMBOLS.get(str(kind), "circle"), size=8, opacity=0.6,
                        color=ARM_COLORS[i % len(ARM_COLORS)])))
    e, k = int(df["num_experts"].iloc[0]), int(df["top_k"].iloc[0])
    hi = max(int(df["tokens"].max()), 2)
    xs = sorted({max(1, round(hi ** (j / 60))) for j in range(61)})
    fig.add_trace(go.Scatter(x=xs, y=[uniform_coverage(e, k, t) for t in xs], mode="lines",
                             name="uniform routing", line=dict(color="#333333", dash="dash")))
    if gamma is not None:
        fig.add_trace(go.Scatter(x=xs, y=[uniform_coverage(e, k, t, gamma) for t in xs],
                                 mode="lines", name=f"fitted γ = {gamma:.2f}",
                                 line=dict(color="#d62728")))
    fig.update_xaxes(type="log", title="tokens in the forward (T)")
    tick_log_axis(fig, xs, axis="x")
    fig.update_yaxes(title=f"distinct experts touched per layer (of {e})", range=[0, e * 1.05])
    return dress(fig, f"Expert coverage: E = {e}, top-{k}<br><sup>markers: measured per "
                      "(forward, MoE layer); dashed: E·(1 − (1 − k/E)^T)</sup>", width, height)


def cost_ratio(df: pd.DataFrame, width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Verify/decode cost ratio vs decode batch. ``df``: columns ``target``, ``batch``,
    ``ratio`` (measured or what-if) and optionally ``predicted`` (the cost model's); one
    line per target (trace = target) and, dotted, its prediction (trace ``<target> model``)."""
    require(df, ("target", "batch", "ratio"), "cost_ratio")
    fig = go.Figure()
    for i, (name, g) in enumerate(df.groupby("target", sort=False)):
        color = ARM_COLORS[i % len(ARM_COLORS)]
        fig.add_trace(go.Scatter(x=g["batch"], y=g["ratio"], mode="lines+markers",
                                 name=str(name), line=dict(color=color),
                                 text=[f"{v:.2f}×" for v in g["ratio"]],
                                 textposition="top center"))
        if "predicted" in g:
            fig.add_trace(go.Scatter(x=g["batch"], y=g["predicted"], mode="lines",
                                     name=f"{name} model", line=dict(color=color, dash="dot")))
    batches: Sequence[float] = sorted(df["batch"].unique().tolist())
    fig.update_xaxes(type="log", title="decode batch B")
    tick_log_axis(fig, batches, axis="x")
    fig.update_yaxes(title="verify (B·N tokens) ÷ decode (B tokens)", rangemode="tozero")
    return dress(fig, "What a verify costs in decode steps, by batch", width, height)
