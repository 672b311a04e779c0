"""Controls over recorded runs (ipywidgets): pick a setting, read what the recorded data say
about it, in computed prose with its interval and a figure.

* :class:`ShapeControl` — a tree shape (S, K, N) out of a recorded S × K × N sweep: its τ,
  its speedup claim (words from the interval) and its place among all the shapes.
* :class:`ThresholdControl` — a speculation policy over a recorded concurrency sweep: a
  ``BatchThreshold(n)`` composed from the measured baseline and always-on arms (speculate at
  c ≤ n), or any measured policy arm, against the envelope (the better arm at each level).

Neither touches an engine: they re-read the recorded frames, so they work on saved results.
Like :class:`workbench.viz.widgets.Explorer`, each change puts a *new* FigureWidget into the
box, so an exported page shows the last selection (a static snapshot: the callbacks need a
live kernel). Tests drive them headlessly through :meth:`ShapeControl.select` and
:meth:`ThresholdControl.select` (or the widgets' ``.value``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ipywidgets as W
import plotly.graph_objects as go

from workbench.viz import figures
from workbench.viz import prose as P

if TYPE_CHECKING:
    import pandas as pd


def _shape_key(r: Any) -> tuple[int, int, int]:
    return int(r["num_steps"]), int(r["topk"]), int(r["num_draft_tokens"])


class ShapeControl:
    """Pick a tree shape of a recorded sweep: ``sweep`` has one row per shape with
    ``num_steps``, ``topk``, ``num_draft_tokens``, ``tau``, ``speedup`` and optionally
    ``speedup_lo``/``speedup_hi``, ``n`` and ``flags``. Starts on the fastest shape."""

    def __init__(self, sweep: pd.DataFrame) -> None:
        figures.style.require(sweep, ("num_steps", "topk", "num_draft_tokens", "tau",
                                      "speedup"), "ShapeControl")
        if sweep.empty:
            raise ValueError("ShapeControl: the sweep has no rows")
        self.sweep = sweep.reset_index(drop=True)
        self.rows = {_shape_key(r): r for r in self.sweep.to_dict(orient="records")}
        best = max(self.rows.values(), key=lambda r: r["speedup"])
        s0, k0, n0 = _shape_key(best)
        style = {"description_width": "90px"}
        self.s = W.Dropdown(options=sorted({k[0] for k in self.rows}), value=s0,
                            description="S (steps)", style=style)
        self.k = W.Dropdown(options=sorted({k[1] for k in self.rows}), value=k0,
                            description="K (top-k)", style=style)
        self.n = W.Dropdown(options=self._ns(s0, k0), value=n0, description="N (nodes)",
                            style=style)
        self.text = W.HTML()
        self.figure: go.FigureWidget | None = None
        self.box = W.Box(layout=W.Layout(width=f"{figures.WIDTH}px"))
        self._busy = False
        for w in (self.s, self.k, self.n):
            w.observe(self._changed, names="value")
        self.widget = W.VBox([W.HBox([self.s, self.k, self.n]), self.text, self.box])
        self._render()

    def _ns(self, s: int, k: int) -> list[int]:
        return sorted(n for (ss, kk, n) in self.rows if ss == s and kk == k)

    def _changed(self, change: Any = None) -> None:
        if self._busy:
            return
        self._busy = True
        try:
            ns = self._ns(self.s.value, self.k.value)
            if not ns:  # this (S, K) was not recorded: the nearest K that was
                ks = sorted(kk for (ss, kk, _) in self.rows if ss == self.s.value)
                self.k.value = min(ks, key=lambda kk: abs(kk - self.k.value))
                ns = self._ns(self.s.value, self.k.value)
            keep = self.n.value if self.n.value in ns else ns[-1]
            self.n.options = ns
            self.n.value = keep
        finally:
            self._busy = False
        self._render()

    def select(self, s: int, k: int, n: int) -> dict[str, Any]:
        """Select a recorded shape (as the dropdowns would); returns its row."""
        if (s, k, n) not in self.rows:
            raise ValueError(f"ShapeControl: S{s} K{k} N{n} is not in the recorded sweep; "
                             f"recorded: {sorted(self.rows)}")
        self._busy = True
        try:
            self.s.value, self.k.value = s, k
            self.n.options = self._ns(s, k)
            self.n.value = n
        finally:
            self._busy = False
        self._render()
        return self.current

    @property
    def current(self) -> dict[str, Any]:
        return self.rows[(self.s.value, self.k.value, self.n.value)]

    def claim(self) -> P.Claim:
        r = self.current
        return P.ratio(f"S{r['num_steps']} K{r['topk']} N{r['num_draft_tokens']}",
                       r["speedup"], r.get("speedup_lo"), r.get("speedup_hi"),
                       n=int(r["n"]) if r.get("n") == r.get("n") and r.get("n") else None)

    def _render(self) -> None:
        r = self.current
        rank = 1 + sum(1 for o in self.rows.values() if o["tau"] > r["tau"])
        flags = str(r.get("flags") or "")
        self.text.value = P.prose_html(
            self.claim(), f" at τ = {r['tau']:.2f} (rank {rank} of {len(self.rows)} by τ)",
            f" ⚠ {flags}" if flags else "", ".")
        old = self.figure
        self.figure = go.FigureWidget(self.scatter())
        self.box.children = (self.figure,)
        if old is not None:
            old.close()

    def scatter(self) -> go.Figure:
        """τ against speedup for every recorded shape; the selected one highlighted."""
        df = self.sweep
        has_ci = {"speedup_lo", "speedup_hi"} <= set(df.columns)
        fig = go.Figure()
        sel = self.current
        labels = [f"S{a} K{b} N{c}" for a, b, c in zip(df["num_steps"], df["topk"],
                                                      df["num_draft_tokens"], strict=True)]
        colors = [figures.interval_color(lo, hi) for lo, hi in zip(
            df["speedup_lo"] if has_ci else [None] * len(df),
            df["speedup_hi"] if has_ci else [None] * len(df), strict=True)]
        err = None
        if has_ci:
            err = dict(type="data", symmetric=False,
                       array=(df["speedup_hi"] - df["speedup"]).fillna(0).tolist(),
                       arrayminus=(df["speedup"] - df["speedup_lo"]).fillna(0).tolist(),
                       color="#999999", thickness=1)
        fig.add_trace(go.Scatter(x=df["tau"], y=df["speedup"], mode="markers", name="shapes",
                                 text=labels, error_y=err,
                                 marker=dict(size=9, color=colors, line=dict(color="#555555",
                                                                             width=1)),
                                 hovertemplate="%{text}: τ %{x:.2f}, %{y:.2f}×<extra></extra>"))
        fig.add_trace(go.Scatter(
            x=[sel["tau"]], y=[sel["speedup"]], mode="markers+text", name="selected",
            text=[f"S{sel['num_steps']} K{sel['topk']} N{sel['num_draft_tokens']}"],
            textposition="top center", marker=dict(size=18, symbol="circle-open",
                                                   color="#111111", line=dict(width=3))))
        fig.add_hline(y=1.0, line=dict(color="#555555", dash="dash"),
                      annotation_text="1.0× = baseline", annotation_position="bottom right")
        fig.update_xaxes(title=figures.label("tau"))
        fig.update_yaxes(title=figures.label("speedup"), rangemode="tozero")
        return figures.style.dress(
            fig, "The recorded sweep: τ vs speedup per shape (selected: ringed)<br><sup>"
                 "markers green/red only when the 95 % interval is wholly above/below 1×</sup>",
            figures.WIDTH, 380, showlegend=False, margin=dict(l=60, r=30, t=80, b=50))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


class ThresholdControl:
    """Pick a policy over a recorded concurrency sweep.

    ``table``: one row per (arm, concurrency) with ``tok_s`` (means over repeats; arms
    ``baseline`` and ``eagle3`` required). ``ratio`` (optional): the paired per-repeat ratio to
    the baseline per (arm, concurrency) with ``ratio``, ``ratio_lo``, ``ratio_hi``, ``n``.
    The policy dropdown offers ``BatchThreshold(n)`` — composed from the measured arms: eagle3's
    tok/s at c ≤ n, the baseline's above (no switch cost counted: an estimate, said so) — and
    every other measured arm; the slider sets n."""

    COMPOSED = "BatchThreshold(n) from the sweep"

    def __init__(self, table: pd.DataFrame, ratio: pd.DataFrame | None = None,
                 title: str = "the recorded sweep") -> None:
        figures.style.require(table, ("arm", "concurrency", "tok_s"), "ThresholdControl")
        arms = list(dict.fromkeys(table["arm"]))
        for need in ("baseline", "eagle3"):
            if need not in arms:
                raise ValueError(f"ThresholdControl: arm {need!r} missing; got {arms}")
        self.table = table
        self.ratio = ratio
        self.title = title
        self.tok = table.groupby(["arm", "concurrency"])["tok_s"].mean().unstack("arm")
        self.levels = [int(c) for c in self.tok.index]
        others = [a for a in arms if a not in ("baseline", "eagle3")]
        self.policy = W.Dropdown(options=[self.COMPOSED, *others], value=self.COMPOSED,
                                 description="policy", style={"description_width": "60px"},
                                 layout=W.Layout(width="380px"))
        self.n = W.SelectionSlider(options=[0, *self.levels], value=self.levels[0],
                                   description="n", style={"description_width": "30px"})
        self.text = W.HTML()
        self.figure: go.FigureWidget | None = None
        self.box = W.Box(layout=W.Layout(width=f"{figures.WIDTH}px"))
        self.policy.observe(self._changed, names="value")
        self.n.observe(self._changed, names="value")
        self.widget = W.VBox([W.HBox([self.policy, self.n]), self.text, self.box])
        self._changed()

    def select(self, policy: str | None = None, n: int | None = None) -> pd.Series:
        """Set the policy (an arm, or :attr:`COMPOSED`) and/or n; returns its tok/s by level."""
        if policy is not None:
            if policy not in self.policy.options:
                raise ValueError(f"ThresholdControl: policy {policy!r} not in "
                                 f"{list(self.policy.options)}")
            self.policy.value = policy
        if n is not None:
            if n not in self.n.options:
                raise ValueError(f"ThresholdControl: n = {n} not in {list(self.n.options)}")
            self.n.value = n
        return self.curve()

    def curve(self) -> pd.Series:
        """tok/s per level of the selected policy."""
        if self.policy.value != self.COMPOSED:
            return self.tok[self.policy.value]
        n = int(self.n.value)
        return self.tok.apply(lambda row: row["eagle3"] if row.name <= n else row["baseline"],
                              axis=1)

    def envelope(self) -> pd.Series:
        return self.tok[["baseline", "eagle3"]].max(axis=1)

    def _changed(self, change: Any = None) -> None:
        self.n.disabled = self.policy.value != self.COMPOSED
        self.text.value = P.prose_html(*self.sentences())
        old = self.figure
        self.figure = go.FigureWidget(self.plot())
        self.box.children = (self.figure,)
        if old is not None:
            old.close()

    def sentences(self) -> list[Any]:
        """The prose under the control: the share of the envelope reached, and for each level
        where the composed policy speculates, whether speculation is resolved to pay there."""
        cur, env = self.curve(), self.envelope()
        share = cur / env
        name = (f"BatchThreshold({self.n.value})" if self.policy.value == self.COMPOSED
                else self.policy.value)
        out: list[Any] = [f"{name} on {self.title}: {share.min():.0%}–{share.max():.0%} of the "
                          f"envelope across c = {', '.join(str(c) for c in self.levels)}."]
        if self.policy.value == self.COMPOSED:
            out.append(" Composed from the measured arms (no switch cost counted).")
            if self.ratio is not None:
                e3 = self.ratio[self.ratio["arm"] == "eagle3"].set_index("concurrency")
                for c in self.levels:
                    if c in e3.index:
                        r = e3.loc[c]
                        speculates = c <= int(self.n.value)
                        out += [P.BR, f"c = {c} ({'speculates' if speculates else 'plain'}): ",
                                P.ratio("always-on EAGLE-3", r["ratio"], r.get("ratio_lo"),
                                        r.get("ratio_hi"),
                                        n=int(r["n"]) if "n" in r and r["n"] == r["n"]
                                        else None)]
        return out

    def plot(self) -> go.Figure:
        fig = go.Figure()
        xs = self.levels
        for arm in ("eagle3", "baseline"):
            st = figures.arm_style(arm)
            fig.add_trace(go.Scatter(x=xs, y=self.tok[arm].tolist(), name=arm,
                                     mode="lines+markers",
                                     line=dict(color=st["color"], width=st["width"],
                                               dash=st["dash"])))
        fig.add_trace(go.Scatter(x=xs, y=self.envelope().tolist(), name="envelope",
                                 mode="lines", line=dict(color="#bbbbbb", width=10),
                                 opacity=0.4))
        name = (f"BatchThreshold({self.n.value}) (composed)"
                if self.policy.value == self.COMPOSED else str(self.policy.value))
        fig.add_trace(go.Scatter(x=xs, y=self.curve().tolist(), name=name, mode="lines+markers",
                                 line=dict(color="#1f77b4", width=3, dash="dot"),
                                 marker=dict(size=10, symbol="diamond")))
        if self.policy.value == self.COMPOSED and int(self.n.value) > 0:
            fig.add_vline(x=int(self.n.value), line=dict(color="#1f77b4", dash="dash"))
        fig.update_xaxes(title=figures.label("concurrency"), type="log",
                         tickvals=xs, ticktext=[str(c) for c in xs])
        fig.update_yaxes(title="tok/s", rangemode="tozero")
        top = max(float(self.tok.max().max()), 1.0)
        fig.update_yaxes(range=[0, top * 1.15])
        return figures.style.dress(fig, f"Policy over {self.title}: tok/s by concurrency",
                                   figures.WIDTH, 380,
                                   legend=dict(orientation="h", y=-0.25, x=0),
                                   margin=dict(l=60, r=30, t=60, b=90))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

