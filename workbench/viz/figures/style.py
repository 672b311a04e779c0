"""What every figure shares: default size, font, one colour per meaning, one look per
benchmark arm, axis labels, the sanity-flag mark, and the layout and column checks each figure
ends and starts with."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go

from workbench.viz.prose import ABOVE, BELOW, verdict

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
    (``kw`` overrides and extends the layout; a ``<sup>`` subtitle gets a taller top margin)."""
    kw.setdefault("margin", dict(l=60, r=30, t=60, b=50))
    if "<sup>" in title:  # a subtitle line: room so it never runs into the panel titles
        kw["margin"] = {**kw["margin"], "t": max(kw["margin"].get("t", 60), 100)}
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


# ---- figures bound by their intervals ------------------------------------------------------
FASTER = "#2ca02c"  # the whole interval above 1×
SLOWER = "#d62728"  # the whole interval below 1×
NEUTRAL = "#c7c7c7"  # the interval straddles 1× (or there is none): no colour claims a side
MIN_P99_SAMPLES = 100  # a p99 from fewer samples is its maximum, not a tail estimate


def interval_color(lo: float | None, hi: float | None, ref: float = 1.0) -> str:
    """:data:`FASTER` / :data:`SLOWER` only when the interval [lo, hi] lies wholly on one side
    of ``ref``; :data:`NEUTRAL` when it straddles it or is missing (a point estimate alone
    never colours a side)."""
    v = verdict(lo, hi, ref)
    return FASTER if v == ABOVE else SLOWER if v == BELOW else NEUTRAL


def log_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Tick values 1, 2, 5 × 10^k from the nearest one at or below ``lo`` to the nearest one at
    or above ``hi`` (both > 0) and their labels ("0.5", "1", "2", "5", "10", "20", "50",
    "100", "200", "1k" …): a log axis reads as real values, in order, never "2, 5, 100, 2,
    5", and both ends of the data carry a labelled tick."""
    if not (lo > 0 and hi > 0):
        raise ValueError(f"log_ticks: bounds must be > 0, got {lo}, {hi}")
    lo, hi = min(lo, hi), max(lo, hi)
    k0, k1 = math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1
    vals = [m * 10.0 ** k for k in range(k0, k1 + 1) for m in (1, 2, 5)]
    first = max(v for v in vals if v <= lo * 1.0001)
    last = min(v for v in vals if v >= hi / 1.0001)
    inside = [float(f"{v:.6g}") for v in vals if first <= v <= last]
    return inside, [_tick_text(v) for v in inside]


def _tick_text(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e3:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def tick_log_axis(fig: go.Figure, values: Sequence[float], axis: str = "y",
                  **where: Any) -> None:
    """Make an axis log-scaled with :func:`log_ticks` over the positive ``values`` it shows
    (``where``: ``row``/``col`` of a subplot)."""
    vals = [float(v) for v in values if v is not None and v == v and float(v) > 0]
    if not vals:
        return
    tv, tt = log_ticks(min(vals), max(vals))
    upd = fig.update_yaxes if axis == "y" else fig.update_xaxes
    pad = 0.02 * (math.log10(tv[-1]) - math.log10(tv[0]))  # the end ticks stay inside
    upd(type="log", tickvals=tv, ticktext=tt,
        range=[math.log10(tv[0]) - pad, math.log10(tv[-1]) + pad], **where)


def percentile_text(samples: Sequence[float], q: float) -> tuple[float | None, str]:
    """(value, label) of the ``q``-th percentile with its n: ``p50 3.1 ms (n = 40)``. A p99
    (q ≥ 99) from fewer than :data:`MIN_P99_SAMPLES` samples is not estimated: (None,
    ``p99 n/a (n = 8 < 100)``)."""
    import numpy as np

    xs = [float(s) for s in samples if s == s]
    n = len(xs)
    name = f"p{q:g}"
    if n == 0:
        return None, f"{name} n/a (n = 0)"
    if q >= 99 and n < MIN_P99_SAMPLES:
        return None, f"{name} n/a (n = {n} < {MIN_P99_SAMPLES})"
    v = float(np.percentile(xs, q))
    return v, f"{name} {v:.1f} ms (n = {n})"
