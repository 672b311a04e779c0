"""One draft tree, drawn: tidy-tree layout, the accepted path lit, the target's bonus token;
and picking which verified tree to draw."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go

from workbench.viz.figures.style import (
    ACCEPTED,
    FONT,
    REJECTED,
    ROOT,
    TARGET,
    WIDTH,
    dress,
    require,
)

if TYPE_CHECKING:
    import pandas as pd


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
    require(tree_df, ("step", "rid", "node", "token", "parent", "draft_prob", "accepted",
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
    return dress(fig, f"Draft tree — step {step}, request {rid}: {len(nodes)} nodes, {sub}",
                 width, h, legend=dict(orientation="h", y=1.0, yanchor="bottom", x=0),
                 margin=dict(l=30, r=30, t=90, b=50))


def accepted_path(tree_df: pd.DataFrame, step: int, rid: int) -> list[int]:
    """Node indices of the accepted path of one tree (root first), from ``frame("tree")``."""
    t = tree_df[(tree_df["step"] == step) & (tree_df["rid"] == rid)].sort_values("node")
    return [int(n) for n, a in zip(t["node"], t["accepted"], strict=True) if a]


def pick_tree(verify_df: pd.DataFrame, which: str = "longest") -> tuple[int, int]:
    """(step, rid) of a verified tree: ``longest`` accepted path, ``shortest``, or ``first``."""
    require(verify_df, ("step", "rid", "accept_length"), "pick_tree")
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
