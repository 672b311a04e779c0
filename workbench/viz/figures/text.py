"""Generated text coloured by where each token came from: accepted drafts or the target."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.viz.figures.style import ACCEPTED, FONT, TARGET, WIDTH, dress


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
    return dress(fig, f"Generated text: {share:.0%} of {len(from_draft)} tokens came from "
                      "accepted drafts", width, h, showlegend=True,
                 legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"))
