"""Trace DataFrames → plotly figures. Every function returns a ``plotly.graph_objects.Figure``
with an explicit width/height, a title and axis labels, and takes the tidy frames of
:mod:`workbench.trace.frame` (``tracer.frame(kind)``) or a benchmark table.

=========================  ==================================================================
function                   input
=========================  ==================================================================
``draft_tree``             ``frame("tree")``: one draft tree (step, rid), accepted path lit
``acceptance_by_depth``    ``frame("accept_by_depth")`` (optionally one group per ``by``)
``acceptance_vs_conf``     ``frame("tree")``: acceptance rate vs the draft's own probability
``tau_histogram``          ``frame("verify")``: accept length τ per verify step (bonus included)
``phase_timeline``         ``frame("timing")`` or ``frame("timing_long")``: stacked ms per step
``phase_breakdown``        ``frame("timing")``: mean ms per phase, spec vs plain steps
``accept_rate_by_position`` ``frame("verify")`` → α_d table (vLLM per-position, EAGLE n-α)
``alpha_by_position``      that table: α_d and conditional α per draft position
``speedup_heatmap``        any table with x, y, value (and an optional facet) columns
``speedup_bars``           ``run_spec_bench(...).summary``: tok/s ratio and τ per arm
``concurrency_curves``     concurrency sweep table (see :data:`CONCURRENCY_COLUMNS`)
``speedup_vs_batch``       per (arm, concurrency) speedup with ``_lo``/``_hi`` intervals
``latency_cdf``            latency samples (ms): empirical CDF per arm, p50/p99
``policy_timeline``        ``frame("policy")``: decode batch, speculate or not, step time
``init_stages``            ``frame("init")``: engine init stages and their status
``warm_vs_cold``           ``bench.concurrency.switch_costs``: cost of switching, warm vs cold
``training_curves``        ``train_draft`` summary ``history``: loss and per-step accuracy
``colored_text``           token ids + ``RequestOutput.from_draft``: text coloured by source
=========================  ==================================================================

Tests read the figures' data (``fig.data``, ``fig.layout``), not pixels.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.trace.frame import TIMING_PHASES

if TYPE_CHECKING:
    import pandas as pd

WIDTH = 900
HEIGHT = 450
FONT = "Menlo, Consolas, 'DejaVu Sans Mono', monospace"

# One colour per meaning, used the same way in every figure.
ACCEPTED = "#2ca02c"  # drafted and accepted
REJECTED = "#9e9e9e"  # drafted, not on the accepted path
TARGET = "#1f77b4"  # produced by the target (bonus / plain decode)
ROOT = "#444444"
SPEC = "#2ca02c"
PLAIN = "#7f7f7f"
PHASE_COLORS = {"schedule": "#bcbd22", "prefill": "#7f7f7f", "draft": "#ff7f0e",
                "verify": "#1f77b4", "decode": "#2ca02c", "accept": "#9467bd",
                "commit": "#8c564b", "extend": "#17becf"}
ARM_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22", "#17becf")


def _layout(fig: go.Figure, title: str, width: int, height: int, **kw: Any) -> go.Figure:
    kw.setdefault("margin", dict(l=60, r=30, t=60, b=50))
    fig.update_layout(title=dict(text=title, x=0.01, xanchor="left"), width=width,
                      height=height, template="plotly_white", **kw)
    return fig


def _require(df: pd.DataFrame, cols: Sequence[str], what: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{what}: missing column(s) {missing}; got {list(df.columns)}")


def token_label(token: int, tokenizer: Any = None) -> str:
    """Printable text of one token: newlines as ⏎, tabs as ⇥, leading/trailing spaces as ·."""
    if tokenizer is None:
        return str(int(token))
    text = tokenizer.decode([int(token)])
    text = text.replace("\n", "⏎").replace("\t", "⇥")
    stripped = text.strip(" ")
    lead = len(text) - len(text.lstrip(" "))
    trail = len(text) - len(text.rstrip(" "))
    return "·" * lead + stripped + "·" * trail if text else "∅"


# ---- draft trees ----------------------------------------------------------------------------


def tree_layout(parents: Sequence[int]) -> list[tuple[float, float]]:
    """Tidy-tree coordinates (x = depth, y = row) for nodes given parent indices (root: -1).

    Leaves take consecutive rows in depth-first order (children in index order); an inner
    node sits at the mean row of its children. Parents must precede children.
    """
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    depth = [0] * n
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
    row = [0.0] * n
    next_leaf = 0.0
    # iterative post-order so deep chains do not hit the recursion limit
    roots = [i for i, p in enumerate(parents) if p < 0]
    for r in roots:
        stack: list[tuple[int, bool]] = [(r, False)]
        while stack:
            node, seen = stack.pop()
            if not children[node]:
                row[node] = next_leaf
                next_leaf += 1.0
            elif seen:
                row[node] = sum(row[c] for c in children[node]) / len(children[node])
            else:
                stack.append((node, True))
                stack.extend((c, False) for c in reversed(children[node]))
    return [(float(depth[i]), row[i]) for i in range(n)]


def draft_tree(tree_df: pd.DataFrame, step: int, rid: int, tokenizer: Any = None,
               width: int = WIDTH, height: int | None = None) -> go.Figure:
    """One draft tree (``frame("tree")`` rows of ``step``/``rid``) laid out left → right by depth.

    Traces, in order: ``edges`` (all parent→child lines), ``accepted path`` (the accepted
    root→leaf path, thick), ``drafted, not accepted``, ``accepted`` (accepted draft nodes),
    ``root (last verified token)`` and, when the tree was verified, ``bonus edge`` and
    ``bonus (target)`` (the target's own next token after the last accepted node, dashed; drawn
    one depth further on a row below every drafted node, so it never covers a sibling).
    Hover: node, token text, draft prob, target prob, score. ``customdata`` of the node traces
    holds the node indices (-1 for the bonus).
    """
    _require(tree_df, ("step", "rid", "node", "token", "parent", "draft_prob", "accepted",
                       "target_prob", "target_token", "score"), "draft_tree")
    t = tree_df[(tree_df["step"] == step) & (tree_df["rid"] == rid)].sort_values("node")
    if t.empty:
        raise ValueError(f"draft_tree: no tree for step {step}, rid {rid}")
    nodes = t["node"].tolist()
    if nodes != list(range(len(nodes))):
        raise ValueError(f"draft_tree: nodes of step {step}, rid {rid} are not 0..N-1")
    parents = [int(p) for p in t["parent"]]
    pos = tree_layout(parents)
    accepted = [bool(a) for a in t["accepted"]]
    labels = [token_label(tok, tokenizer) for tok in t["token"]]
    hover = []
    for i, row in enumerate(t.itertuples()):
        tp = "–" if math.isnan(row.target_prob) else f"{row.target_prob:.3f}"
        hover.append(f"node {i} (depth {int(pos[i][0])})<br>token {row.token} "
                     f"<b>{html.escape(labels[i])}</b><br>draft p {row.draft_prob:.3f}"
                     f"<br>target p {tp}<br>score {row.score:.2f}")

    def segs(pairs: list[tuple[int, int]]) -> tuple[list[float | None], list[float | None]]:
        xs: list[float | None] = []
        ys: list[float | None] = []
        for a, b in pairs:
            xs += [pos[a][0], pos[b][0], None]
            ys += [pos[a][1], pos[b][1], None]
        return xs, ys

    edges = [(p, i) for i, p in enumerate(parents) if p >= 0]
    path_edges = [(p, i) for i, p in enumerate(parents) if p >= 0 and accepted[i] and accepted[p]]
    fig = go.Figure()
    ex, ey = segs(edges)
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", name="edges", hoverinfo="skip",
                             line=dict(color="#cccccc", width=1.5), showlegend=False))
    px_, py_ = segs(path_edges)
    fig.add_trace(go.Scatter(x=px_, y=py_, mode="lines", name="accepted path", hoverinfo="skip",
                             line=dict(color=ACCEPTED, width=5)))
    groups = (("drafted, not accepted", [i for i in range(len(nodes)) if not accepted[i]],
               REJECTED, 12),
              ("accepted", [i for i in range(1, len(nodes)) if accepted[i]], ACCEPTED, 12),
              ("root (last verified token)", [0], ROOT, 16))
    for name, idx, color, size in groups:
        fig.add_trace(go.Scatter(
            x=[pos[i][0] for i in idx], y=[pos[i][1] for i in idx], mode="markers+text",
            name=name, customdata=idx, text=[labels[i] for i in idx], textposition="top center",
            textfont=dict(family=FONT, size=12), hovertext=[hover[i] for i in idx],
            hoverinfo="text", marker=dict(size=size, color=color,
                                          line=dict(color="white", width=1))))
    verified = bool(t["verified"].iloc[0])
    bonus_tok = None
    if verified:
        last = max((i for i in range(len(nodes)) if accepted[i]), key=lambda i: pos[i][0])
        bonus_tok = int(t["target_token"].iloc[last])
        # The bonus gets a row of its own below every drafted node: at (depth+1, same row) it
        # would sit on a rejected child of the last accepted node (labels overprinted).
        bx, by = pos[last][0] + 1, max(p[1] for p in pos) + 1
        fig.add_trace(go.Scatter(x=[pos[last][0], bx], y=[pos[last][1], by],
                                 mode="lines", line=dict(color=TARGET, width=2, dash="dash"),
                                 hoverinfo="skip", showlegend=False, name="bonus edge"))
        fig.add_trace(go.Scatter(
            x=[bx], y=[by], mode="markers+text", name="bonus (target)", customdata=[-1],
            text=[token_label(bonus_tok, tokenizer)], textposition="top center",
            textfont=dict(family=FONT, size=12, color=TARGET),
            hovertext=[f"bonus token {bonus_tok} from the target"], hoverinfo="text",
            marker=dict(size=12, symbol="diamond", color=TARGET)))
    n_acc = sum(accepted) - 1
    max_depth = max(p[0] for p in pos)
    rows = max(p[1] for p in pos) + (1 if verified else 0)
    sub = (f"τ = {n_acc + 1} ({n_acc} accepted + bonus)" if verified else "not verified")
    fig.update_xaxes(title="depth (draft step)", range=[-0.5, max_depth + 1.6], dtick=1,
                     zeroline=False)
    fig.update_yaxes(title="", range=[rows + 0.8, -0.8], showticklabels=False, zeroline=False,
                     showgrid=False)
    h = height or int(min(900, max(380, 160 + 34 * (rows + 1))))
    return _layout(fig, f"Draft tree — step {step}, request {rid}: {len(nodes)} nodes, {sub}",
                   width, h, legend=dict(orientation="h", y=1.0, yanchor="bottom", x=0),
                   margin=dict(l=30, r=30, t=90, b=50))


def accepted_path(tree_df: pd.DataFrame, step: int, rid: int) -> list[int]:
    """Node indices of the accepted path of one tree (root first), from ``frame("tree")``."""
    t = tree_df[(tree_df["step"] == step) & (tree_df["rid"] == rid)].sort_values("node")
    return [int(n) for n, a in zip(t["node"], t["accepted"], strict=True) if a]


def pick_tree(verify_df: pd.DataFrame, which: str = "longest") -> tuple[int, int]:
    """(step, rid) of a verified tree: ``longest`` accepted path, ``shortest``, or ``first``."""
    _require(verify_df, ("step", "rid", "accept_length"), "pick_tree")
    if verify_df.empty:
        raise ValueError("pick_tree: no verify rows (was speculation on?)")
    if which == "first":
        row = verify_df.iloc[0]
    elif which in ("longest", "shortest"):
        order = verify_df.sort_values(["accept_length", "step"], ascending=[which == "shortest",
                                                                             True], kind="stable")
        row = order.iloc[0]
    else:
        raise ValueError(f"pick_tree: which={which!r} not in longest/shortest/first")
    return int(row["step"]), int(row["rid"])


# ---- acceptance ---------------------------------------------------------------------------


def acceptance_by_depth(df: pd.DataFrame, by: str | None = None, width: int = WIDTH,
                        height: int = HEIGHT) -> go.Figure:
    """Acceptance per draft depth from ``frame("accept_by_depth")``.

    Without ``by``: bars ``node rate`` (accepted / drafted nodes at that depth) and a line
    ``trees reaching depth`` (share of verified trees whose accepted path reaches that depth).
    With ``by`` (a column such as ``arm``): one ``tree_rate`` line per group. y is in [0, 1].
    """
    _require(df, ("depth", "rate", "tree_rate"), "acceptance_by_depth")
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
        _require(df, (by,), "acceptance_by_depth")
        for i, (key, g) in enumerate(df.groupby(by, sort=False)):
            fig.add_trace(go.Scatter(x=g["depth"], y=g["tree_rate"], mode="lines+markers",
                                     name=str(key),
                                     line=dict(color=ARM_COLORS[i % len(ARM_COLORS)])))
    fig.update_xaxes(title="draft depth", dtick=1)
    fig.update_yaxes(title="acceptance", range=[0, 1.05])
    return _layout(fig, "Where drafts are rejected: acceptance by depth", width, height)


def acceptance_vs_confidence(tree_df: pd.DataFrame, bins: int = 10, width: int = WIDTH,
                             height: int = HEIGHT) -> go.Figure:
    """Acceptance of drafted nodes whose parent was accepted, binned by the draft's probability.

    A node can only be accepted if its parent was, so nodes under a rejected parent are left
    out. Traces: ``acceptance`` (line, share accepted per bin) and ``nodes`` (bars, count on
    a second axis). A calibrated draft lies on the diagonal (trace ``calibrated``).
    """
    _require(tree_df, ("step", "rid", "node", "parent", "draft_prob", "accepted", "verified"),
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
    return _layout(fig, "Is the draft's confidence informative? (nodes under an accepted parent)",
                   width, max(height, 480), legend=dict(orientation="h", y=1.0, x=0,
                                                        yanchor="bottom"))


def tau_histogram(verify_df: pd.DataFrame, by: str | None = None, width: int = WIDTH,
                  height: int = HEIGHT) -> go.Figure:
    """Distribution of τ (tokens per verify step, bonus included) from ``frame("verify")``.

    One bar trace per group of ``by`` (or a single trace ``τ``); y is the share of verify
    steps; the title gives the mean τ of each group. Bars are at integers 1..max τ.
    """
    _require(verify_df, ("accept_length",), "tau_histogram")
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
    return _layout(fig, "Accept length per verify step — mean τ: " + ", ".join(means), width,
                   height, barmode="group")


# ---- time ---------------------------------------------------------------------------------


def phase_timeline(timing_df: pd.DataFrame, width: int = WIDTH,
                   height: int = HEIGHT) -> go.Figure:
    """Stacked milliseconds per step and phase (one bar trace per phase, DESIGN.md §4 order).

    Accepts ``frame("timing")`` (wide) or ``frame("timing_long")``. Plain steps book their
    decode forward under ``decode``, prefill chunks run in a step under ``prefill``.
    """
    if "phase" in timing_df.columns:
        _require(timing_df, ("step", "phase", "ms", "mode"), "phase_timeline")
        wide = timing_df.pivot_table(index=["step", "mode"], columns="phase", values="ms",
                                     aggfunc="sum").reset_index()
    else:
        _require(timing_df, ("step", "mode", *(f"{p}_ms" for p in TIMING_PHASES)),
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
    return _layout(fig, "Where a step's time goes", width, height, barmode="stack", bargap=0.1)


def policy_timeline(policy_df: pd.DataFrame, threshold: int | None = None, width: int = WIDTH,
                    height: int = 520) -> go.Figure:
    """Per step: the decode batch and whether the policy speculated (``frame("policy")``).

    Row 1: ``decode batch`` line, ``speculate`` / ``plain`` markers, optional threshold line.
    Row 2: measured step time, bars ``spec step ms`` / ``plain step ms``.
    """
    _require(policy_df, ("step", "decode_batch", "speculate", "measured_ms"), "policy_timeline")
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
    return _layout(fig, "Speculation policy over time", width, height, bargap=0.05)


def init_stages(init_df: pd.DataFrame, width: int = WIDTH, height: int = 380) -> go.Figure:
    """Engine init stages (``frame("init")``) as horizontal bars coloured by status.

    One bar trace per status present (``ok``, ``fallback``, ``failed``); the bar length is the
    stage's seconds (at least a sliver so a stage that failed at once still shows).
    """
    _require(init_df, ("stage", "status", "seconds"), "init_stages")
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
    return _layout(fig, "Engine init, stage by stage", width, height)


# ---- benchmarks ---------------------------------------------------------------------------

# Axis titles for the columns the notebooks plot (a raw column name is not an axis title).
LABELS = {"num_steps": "S (draft steps)", "topk": "K (top-k branching)",
          "num_draft_tokens": "N (verified nodes)", "speedup": "speedup (× baseline)",
          "tau": "τ (tokens per verify)", "concurrency": "concurrent requests",
          "tok_s": "tok/s", "vs_baseline": "tok/s ÷ baseline's", "temperature": "temperature",
          "category": "prompt category"}
SHORT = {"num_steps": "S", "topk": "K", "num_draft_tokens": "N"}
FLAG_MARK = "⚠"


def label(col: str) -> str:
    """Human axis title for a column (``num_draft_tokens`` → ``N (verified nodes)``)."""
    return LABELS.get(col, col.replace("_", " "))


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
    _require(df, [x, y, value] + ([facet] if facet else []) + ([flag] if flag else []),
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
    return _layout(fig, title, width, height)


def speedup_bars(summary: pd.DataFrame, width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Per arm of ``run_spec_bench(...).summary`` (columns arm, speedup, tau; optional
    ``speedup_lo``/``speedup_hi`` for error bars): two panels side by side, each with its own
    axis — left the tok/s ratio to the baseline (trace ``speedup``; green faster, red slower,
    grey the baseline; dashed line at 1.0×), right τ per arm (trace ``τ``)."""
    _require(summary, ("arm", "speedup", "tau"), "speedup_bars")
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
    return _layout(fig, "EAGLE-3 vs baseline: speedup and accept length", width, height,
                   showlegend=False)


def shape_speedups(df: pd.DataFrame, width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Per row of ``workbench.bench.shapes.run_shapes`` (columns shape, speedup, bound,
    verify_ratio). Left panel: measured speedup (bars, trace ``speedup``) and the bound with
    drafting free, τ / verify_ratio (markers, trace ``bound: free drafting``). Right panel,
    its own axis: what verifying N tokens costs in plain steps (trace ``verify / plain
    step``)."""
    _require(df, ("shape", "speedup", "bound", "verify_ratio"), "shape_speedups")
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
    return _layout(fig, "Speedup at a fixed accept length, by target shape", width,
                   height + 60, legend=dict(orientation="h", y=-0.45, x=0),
                   margin=dict(l=60, r=30, t=60, b=140))


# Columns ``concurrency_curves`` reads. Latencies may be in ms (``*_ms``, preferred: the
# workbench.bench.concurrency table) or in seconds without the suffix (converted to ms).
CONCURRENCY_COLUMNS = {
    "required": ("arm", "concurrency", "tok_s"),
    "latency": ("itl_p50_ms", "ttft_p50_ms", "itl_p99_ms", "ttft_p99_ms"),
    "optional": ("tau", "spec_share", "tok_s_lo", "tok_s_hi"),
}

# One look per arm, the same in every figure: the baseline is a thick black line drawn last
# (on top), ``never`` (same tokens as the baseline, drafting off) a dashed grey one.
ARM_STYLE: dict[str, dict[str, Any]] = {
    "baseline": dict(color="#111111", width=3.5, dash="solid"),
    "eagle3": dict(color="#2ca02c", width=2.5, dash="solid"),
    "never": dict(color="#9e9e9e", width=2, dash="dash"),
    "threshold": dict(color="#1f77b4", width=2.5, dash="solid"),
    "goodput": dict(color="#ff7f0e", width=2.5, dash="solid"),
    "flip_warm": dict(color="#9467bd", width=1.5, dash="dot"),
    "flip_cold": dict(color="#8c564b", width=1.5, dash="dot"),
}
_EXTRA = ("#d62728", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
_EXTRA_DASH = ("solid", "dashdot", "longdash", "dot")


def arm_style(arm: str, i: int = 0) -> dict[str, Any]:
    """Line style (color, width, dash) of an arm: :data:`ARM_STYLE`, else distinct extras."""
    if arm in ARM_STYLE:
        return dict(ARM_STYLE[arm])
    return dict(color=_EXTRA[i % len(_EXTRA)], width=2.5,
                dash=_EXTRA_DASH[(i // len(_EXTRA)) % len(_EXTRA_DASH)])


def _arm_order(arms: list[str], baseline: str) -> list[str]:
    """Draw order: the baseline last, so no other arm hides it."""
    return [a for a in arms if a != baseline] + ([baseline] if baseline in arms else [])


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
    _require(df, ("arm", "concurrency", value), "crossovers")
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
    _require(df, CONCURRENCY_COLUMNS["required"], "concurrency_curves")
    arms = list(dict.fromkeys(df["arm"]))
    itl = _latency_ms(df, "itl_p50")
    ttft = _latency_ms(df, "ttft_p50")
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.07,
                        subplot_titles=("throughput (all requests)", "inter-token latency p50",
                                        "time to first token p50"))
    for i, arm in enumerate(_arm_order(arms, baseline)):
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
    return _layout(fig, "Throughput and latency vs concurrency", width, height,
                   legend=dict(orientation="h", y=-0.22, x=0), margin=dict(l=60, r=20, t=70,
                                                                           b=100))


def speedup_vs_batch(df: pd.DataFrame, value: str = "vs_baseline", baseline: str = "baseline",
                     width: int = WIDTH, height: int = HEIGHT) -> go.Figure:
    """Speedup over the baseline against concurrency, one line per arm, with confidence
    intervals: ``df`` has arm, concurrency, ``<value>`` (mean over repeats) and optionally
    ``<value>_lo``/``<value>_hi`` (e.g. ``bench.sanity.ci_columns``) and ``n`` (repeats, in the
    hover) and ``flags`` (sanity codes; a flagged point is drawn as an open ⚠ marker). The
    baseline is the dashed 1.0× line."""
    _require(df, ("arm", "concurrency", value), "speedup_vs_batch")
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
    return _layout(fig, "Speedup vs batch size (mean and 95 % interval over repeats; open "
                        "marker = sanity flag)", width, height)


def latency_cdf(samples: pd.DataFrame, metric: str, by: str = "arm",
                dash_by: str | None = None, log_x: bool = True, width: int = WIDTH,
                height: int = 400) -> go.Figure:
    """Empirical CDF of one latency ``metric`` (a column in ms, e.g. ``ttft_ms``) from a table
    of samples (one row per token gap or request), one line per group of ``by`` (coloured as
    :func:`arm_style`) and, given ``dash_by`` (e.g. ``concurrency``), per value of it (one dash
    each); p50 and p99 of each line in its legend entry and as × markers. x is log scale by
    default (latencies span decades between a plain step and a queued first token)."""
    _require(samples, (by, metric) + ((dash_by,) if dash_by else ()), "latency_cdf")
    fig = go.Figure()
    groups = _arm_order(list(dict.fromkeys(samples[by])), "baseline")
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
    return _layout(fig, f"{name} distribution (CDF; × = p50, p99)", width, height)


def accept_rate_by_position(verify_df: pd.DataFrame, by: str | None = None) -> pd.DataFrame:
    """α_d per draft position from ``frame("verify")`` (one row per verify step; a step
    accepted ``accept_length - 1`` draft tokens, a prefix of the drafted path).

    Columns: [``by``,] ``position`` (1-based), ``drafts`` (verify steps), ``accepted`` (steps
    whose accepted path reached that position — vLLM's ``num_accepted_tokens_per_pos``),
    ``alpha`` = accepted / drafts (vLLM's per-position acceptance rate) and ``alpha_cond`` =
    accepted at d / accepted at d-1 (the EAGLE papers' n-α: acceptance given the previous
    token was accepted; NaN when no step reached d-1).
    """
    _require(verify_df, ("accept_length",) + ((by,) if by else ()), "accept_rate_by_position")
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
    _require(alpha_df, ("position", "alpha", "alpha_cond"), "alpha_by_position")
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
    return _layout(fig, "Acceptance per draft position", width, height)


def phase_breakdown(timing_df: pd.DataFrame, width: int = WIDTH,
                    height: int = 320) -> go.Figure:
    """Mean ms per step and phase (``frame("timing")``), speculative vs plain steps, as one
    stacked horizontal bar per mode (trace per phase, DESIGN.md §4 order): where a step's time
    goes on average — draft, verify, accept, commit. The title gives the step counts."""
    _require(timing_df, ("mode", *(f"{p}_ms" for p in TIMING_PHASES)), "phase_breakdown")
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
    return _layout(fig, "Where a step's time goes, on average", width, height,
                   barmode="stack", legend=dict(orientation="h", y=-0.35, x=0),
                   margin=dict(l=160, r=30, t=60, b=90))


def warm_vs_cold(switch_df: pd.DataFrame, width: int = WIDTH,
                 height: int = HEIGHT) -> go.Figure:
    """What turning speculation off and on costs, warm vs cold draft, per concurrency, from
    ``workbench.bench.concurrency.switch_costs`` (columns concurrency, warm_switch_extra_ms,
    cold_switch_extra_ms, warm_plain_ms, cold_plain_ms).

    Left: extra ms of a speculative step right after an off step (cold pays the draft
    catch-up there). Right: ms of a plain step (warm pays a draft extend on every one).
    Traces ``warm draft`` / ``cold draft`` in each panel (``meta`` = ``switch`` / ``plain``).
    """
    _require(switch_df, ("concurrency", "warm_switch_extra_ms", "cold_switch_extra_ms",
                         "warm_plain_ms", "cold_plain_ms"), "warm_vs_cold")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("extra ms when speculation switches on",
                                        "ms of a plain step"))
    xs = [str(c) for c in switch_df["concurrency"]]
    for col, what in ((1, "switch"), (2, "plain")):
        for state, color in (("warm", "#ff7f0e"), ("cold", "#1f77b4")):
            key = f"{state}_switch_extra_ms" if what == "switch" else f"{state}_plain_ms"
            fig.add_trace(go.Bar(x=xs, y=switch_df[key], name=f"{state} draft",
                                 marker_color=color, legendgroup=state, meta=what,
                                 showlegend=col == 1), row=1, col=col)
    fig.update_xaxes(title="concurrent requests", type="category")
    fig.update_yaxes(title="ms", row=1, col=1)
    fig.update_yaxes(title="ms", rangemode="tozero", row=1, col=2)
    return _layout(fig, "Warm vs cold draft: pay on every plain step, or once per switch",
                   width, height, barmode="group")


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
    return _layout(fig, f"Draft head training (training-time test, {len(history)} points)",
                   width, height)


# ---- text ---------------------------------------------------------------------------------


def _token_pieces(token_ids: Sequence[int], tokenizer: Any) -> list[str]:
    """Text of each token such that ''.join(pieces) == decode(all) for byte-level BPE (a piece
    that ends inside a UTF-8 character is attached to the next one)."""
    if tokenizer is None:
        return [f"[{t}]" for t in token_ids]
    pieces: list[str] = []
    prev = ""
    for i in range(len(token_ids)):
        cur = tokenizer.decode(list(token_ids[: i + 1]))
        if cur.endswith("\ufffd") and i + 1 < len(token_ids):
            pieces.append("")
            continue
        pieces.append(cur[len(prev):])
        prev = cur
    return pieces


def colored_html(token_ids: Sequence[int], from_draft: Sequence[bool], tokenizer: Any = None,
                 prompt: str = "") -> str:
    """An HTML ``<pre>``: tokens from accepted drafts on green, target tokens plain; the
    optional ``prompt`` in grey. Safe to pass to ``IPython.display.HTML``."""
    if len(token_ids) != len(from_draft):
        raise ValueError(f"colored_html: {len(token_ids)} tokens but {len(from_draft)} flags")
    spans = [f'<span style="color:#999">{html.escape(prompt)}</span>'] if prompt else []
    for piece, d in zip(_token_pieces(token_ids, tokenizer), from_draft, strict=True):
        style = f"background:{ACCEPTED}33;border-bottom:2px solid {ACCEPTED}" if d else ""
        spans.append(f'<span style="{style}">{html.escape(piece)}</span>')
    share = sum(from_draft) / max(len(from_draft), 1)
    legend = (f'<div style="font:12px sans-serif;color:#555">'
              f'<span style="background:{ACCEPTED}33">green</span>: from accepted drafts '
              f'({share:.0%} of {len(from_draft)} tokens); plain: from the target</div>')
    return (f'{legend}<pre style="font-family:{FONT};font-size:13px;line-height:1.5;'
            f'white-space:pre-wrap">{"".join(spans)}</pre>')


def colored_text(token_ids: Sequence[int], from_draft: Sequence[bool], tokenizer: Any = None,
                 wrap: int = 96, width: int = WIDTH, height: int | None = None) -> go.Figure:
    """Generated text with each token coloured by its source: ``from accepted drafts`` (green)
    or ``from the target`` (blue: bonus tokens and plain decode). Lines wrap at ``wrap``
    characters; newlines in the text start new lines. Two text traces (in that order), each
    point one token, ``customdata`` = [token index, token id]."""
    if len(token_ids) != len(from_draft):
        raise ValueError(f"colored_text: {len(token_ids)} tokens but {len(from_draft)} flags")
    pieces = _token_pieces(token_ids, tokenizer)
    pts: dict[bool, dict[str, list[Any]]] = {k: {"x": [], "y": [], "t": [], "c": []}
                                             for k in (True, False)}
    col, line = 0, 0
    for i, (piece, d) in enumerate(zip(pieces, from_draft, strict=True)):
        parts = piece.split("\n")
        for j, part in enumerate(parts):
            if j > 0:
                col, line = 0, line + 1
            if col + len(part) > wrap and col > 0:
                col, line = 0, line + 1
            if part:
                shown = part.replace(" ", "\u00a0")
                pts[bool(d)]["x"].append(col + len(part) / 2)
                pts[bool(d)]["y"].append(line)
                pts[bool(d)]["t"].append(shown)
                pts[bool(d)]["c"].append([i, int(token_ids[i])])
                col += len(part)
    fig = go.Figure()
    for flag, name, color in ((True, "from accepted drafts", ACCEPTED),
                              (False, "from the target", TARGET)):
        p = pts[flag]
        fig.add_trace(go.Scatter(x=p["x"], y=p["y"], text=p["t"], mode="text", name=name,
                                 customdata=p["c"], textfont=dict(family=FONT, size=13,
                                                                  color=color),
                                 hovertemplate="token %{customdata[0]} (id %{customdata[1]})"
                                               "<extra>" + name + "</extra>"))
    n_lines = line + 1
    fig.update_xaxes(visible=False, range=[-1, wrap + 1])
    fig.update_yaxes(visible=False, range=[n_lines - 0.5, -0.7])
    share = sum(from_draft) / max(len(from_draft), 1)
    h = height or int(min(1200, 110 + 22 * n_lines))
    return _layout(fig, f"Generated text: {share:.0%} of {len(from_draft)} tokens came from "
                        "accepted drafts", width, h, showlegend=True,
                   legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"))
