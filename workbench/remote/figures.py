"""The routing figure: per decode batch size, the draft steps SGLang runs (its adaptive tier after
padding) beside the workbench policy's decision, disagreements marked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go

if TYPE_CHECKING:
    import pandas as pd

SGLANG, POLICY, DIFFER = "#1f77b4", "#ff7f0e", "#d62728"


def routing_figure(table: pd.DataFrame, title: str = "", width: int = 900,
                   height: int = 380) -> go.Figure:
    """``plan.routing_table()`` → step plot: SGLang's steps (solid, hover: padded size and
    tier), the policy's (dashed), batch sizes where they differ as red crosses, tier
    boundaries as dotted lines."""
    for col in ("batch_size", "padded", "tier", "sglang_steps", "policy_steps", "agree"):
        if col not in table:
            raise ValueError(f"routing_figure: table has no column {col!r} "
                             "(pass plan.routing_table())")
    fig = go.Figure()
    hover = [f"batch {b} → padded {p} → tier {t}: {s} steps"
             for b, p, t, s in zip(table.batch_size, table.padded, table.tier,
                                   table.sglang_steps, strict=True)]
    fig.add_trace(go.Scatter(x=table.batch_size, y=table.sglang_steps, mode="lines+markers",
                             line={"shape": "hv", "color": SGLANG, "width": 3},
                             marker={"size": 5}, name="SGLang (adaptive tier)",
                             hovertext=hover, hoverinfo="text"))
    decided = table[table.policy_steps.notna()]
    fig.add_trace(go.Scatter(x=decided.batch_size, y=decided.policy_steps.astype(float),
                             mode="lines", line={"shape": "hv", "color": POLICY, "dash": "dash",
                                                 "width": 2},
                             name="workbench policy"))
    bad = table[~table.agree & table.policy_steps.notna()]
    if len(bad):
        fig.add_trace(go.Scatter(x=bad.batch_size, y=bad.sglang_steps, mode="markers",
                                 marker={"symbol": "x", "size": 11, "color": DIFFER},
                                 name="differs (padding / no tiers)"))
    starts: list[Any] = sorted(set(table.tier))[1:]
    for t in starts:
        fig.add_vline(x=t - 0.5, line={"dash": "dot", "color": "#888", "width": 1})
    top = max(float(table.sglang_steps.max()), float(decided.policy_steps.max() or 0), 1.0)
    fig.update_yaxes(title="draft steps per round (0 = plain decode)", range=[-0.4, top + 0.8])
    fig.update_xaxes(title="decode batch size (running requests)")
    fig.update_layout(title=title or "Where SGLang drafts, by batch size", width=width,
                      height=height, template="plotly_white",
                      legend={"orientation": "h", "y": -0.25})
    return fig
