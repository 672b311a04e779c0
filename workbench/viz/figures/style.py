"""What every figure shares: default size, font, one colour per meaning, one look per
benchmark arm, axis labels, the sanity-flag mark, and the layout and column checks each figure
ends and starts with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go

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

# Axis titles for the columns the notebooks plot (a raw column name is not an axis title).
LABELS = {"num_steps": "S (draft steps)", "topk": "K (top-k branching)",
          "num_draft_tokens": "N (verified nodes)", "speedup": "speedup (× baseline)",
          "tau": "τ (tokens per verify)", "concurrency": "concurrent requests",
          "tok_s": "tok/s", "vs_baseline": "tok/s ÷ baseline's", "temperature": "temperature",
          "category": "prompt category"}
SHORT = {"num_steps": "S", "topk": "K", "num_draft_tokens": "N"}
FLAG_MARK = "⚠"  # after the value of a cell or point that carries a sanity flag


def dress(fig: go.Figure, title: str, width: int, height: int, **kw: Any) -> go.Figure:
    """The last call of every figure: title (left), explicit size, white template, margins
    (``kw`` overrides and extends the layout)."""
    kw.setdefault("margin", dict(l=60, r=30, t=60, b=50))
    fig.update_layout(title=dict(text=title, x=0.01, xanchor="left"), width=width,
                      height=height, template="plotly_white", **kw)
    return fig


def require(df: pd.DataFrame, cols: Sequence[str], what: str) -> None:
    """The first call of every figure: ValueError naming ``what`` and the missing columns."""
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{what}: missing column(s) {missing}; got {list(df.columns)}")


def label(col: str) -> str:
    """Human axis title for a column (``num_draft_tokens`` → ``N (verified nodes)``)."""
    return LABELS.get(col, col.replace("_", " "))


def arm_style(arm: str, i: int = 0) -> dict[str, Any]:
    """Line style (color, width, dash) of an arm: :data:`ARM_STYLE`, else distinct extras."""
    if arm in ARM_STYLE:
        return dict(ARM_STYLE[arm])
    return dict(color=_EXTRA[i % len(_EXTRA)], width=2.5,
                dash=_EXTRA_DASH[(i // len(_EXTRA)) % len(_EXTRA_DASH)])


def arm_order(arms: list[str], baseline: str) -> list[str]:
    """Draw order: the baseline last, so no other arm hides it."""
    return [a for a in arms if a != baseline] + ([baseline] if baseline in arms else [])
