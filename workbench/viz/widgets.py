"""ipywidgets panels: :class:`Explorer` (drive an engine one verify step at a time and watch the
draft tree) and :class:`SweepProgress` (live progress and a live plot for sweeps).

Both keep their logic in plain methods (``Explorer.step()``, ``SweepProgress.update()``) that
the buttons call, so tests drive them headlessly: set ``.value`` on a control, call
``button.click()``, read the figure's data. Exported HTML keeps a snapshot of the widgets;
the callbacks need a live kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets as W
import plotly.graph_objects as go

from workbench.config import SamplingParams, SpecConfig
from workbench.errors import WorkbenchError
from workbench.policy.policies import Always, BatchThreshold, Never, Policy
from workbench.trace.events import Event, Prefill, Verified
from workbench.trace.frame import frame
from workbench.trace.tracer import trace
from workbench.viz import figures

if TYPE_CHECKING:
    import pandas as pd

    from workbench.engine.engine import Engine

POLICIES = ("Always", "BatchThreshold", "off")


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`Explorer.step` did."""

    engine_steps: int  # engine.step() calls (prefill steps included)
    verify_step: int | None  # engine step id of the verify, None for a plain step
    accept_length: int | None  # τ of that verify step (bonus included)
    new_tokens: int
    finished: bool


class Explorer:
    """Interactive EAGLE-3 explorer for one request on ``engine``.

    Controls: prompt, S (draft steps) / K (top-k) / N (verified nodes) sliders, policy dropdown
    (``Always``, ``BatchThreshold`` with its threshold, ``off`` = the ``Never`` policy, which
    keeps the draft warm so speculation can come back), max new tokens; buttons ``step``
    (advance to the next verify step and redraw the tree), ``run`` (to the end) and ``reset``.
    The tree is a ``plotly.graph_objects.FigureWidget`` (``.tree``, None until the first
    verified step) shown in ``.tree_box``; until then, and on a plain step, the box holds
    ``.placeholder`` (an HTML message) instead. Each redraw puts a *new* FigureWidget built
    from the tree into the box (and closes the old one): the browser swaps the box's child, so
    no stale placeholder can survive in the view (plotly's widget view ignores removed layout
    properties), and a saved or exported notebook shows the latest tree (a FigureWidget's saved
    state is the figure it was created with). The text so far is coloured by source
    (``.text``). Setting changes apply from the next step on. Lossless: greedy
    output equals the baseline's whatever the settings, which the tests check.

    ``Explorer(engine)`` displays itself as the last expression of a cell (``.widget``).
    """

    def __init__(self, engine: Engine, prompt: str = "def fnmatch(name, pat):",
                 num_steps: int = 5, topk: int = 4, num_draft_tokens: int = 16,
                 max_new_tokens: int = 64) -> None:
        self.engine = engine
        self.has_draft = engine.runner.draft is not None
        self.rid: int | None = None
        self.events: list[Event] = []
        self.reports: list[StepReport] = []
        style = {"description_width": "110px"}
        self.prompt = W.Textarea(value=prompt, description="prompt", style=style,
                                 layout=W.Layout(width="560px", height="64px"))
        self.num_steps = W.IntSlider(value=num_steps, min=1, max=8, description="S (steps)",
                                     style=style)
        self.topk = W.IntSlider(value=topk, min=1, max=8, description="K (top-k)", style=style)
        self.num_draft_tokens = W.IntSlider(value=2, min=2, max=64, description="N (verify)",
                                            style=style)
        self.policy = W.Dropdown(options=POLICIES, value="Always", description="policy",
                                 style=style)
        self.threshold = W.BoundedIntText(value=8, min=0, max=4096, description="threshold",
                                          style=style, layout=W.Layout(width="200px"))
        self.max_new_tokens = W.IntSlider(value=max_new_tokens, min=1, max=512,
                                          description="max tokens", style=style)
        self.step_button = W.Button(description="step", icon="step-forward",
                                    tooltip="advance to the next verify step")
        self.run_button = W.Button(description="run", icon="play", tooltip="run to the end")
        self.reset_button = W.Button(description="reset", icon="undo",
                                     tooltip="abort the request; the next step starts afresh")
        self.status = W.HTML()
        self.text = W.HTML()
        self.placeholder = W.HTML(self._message("press step to draft a tree"))
        self.tree: go.FigureWidget | None = None
        self.tree_box = W.Box([self.placeholder],
                              layout=W.Layout(min_height="120px", width=f"{figures.WIDTH}px"))
        self.topk.observe(self._on_shape, names="value")
        self.num_steps.observe(self._on_shape, names="value")
        self.policy.observe(self._on_policy, names="value")
        self.step_button.on_click(lambda _: self._guarded(self.step))
        self.run_button.on_click(lambda _: self._guarded(self.run))
        self.reset_button.on_click(lambda _: self.reset())
        self._on_shape()
        self.num_draft_tokens.value = min(num_draft_tokens, self.num_draft_tokens.max)
        self._on_policy()
        if not self.has_draft:
            for w in (self.num_steps, self.topk, self.num_draft_tokens, self.policy,
                      self.threshold):
                w.disabled = True
        self._set_status("ready" if self.has_draft else "this engine has no draft model: "
                         "plain decoding only")
        controls = W.VBox([
            self.prompt,
            W.HBox([W.VBox([self.num_steps, self.topk, self.num_draft_tokens]),
                    W.VBox([self.policy, self.threshold, self.max_new_tokens])]),
            W.HBox([self.step_button, self.run_button, self.reset_button]),
            self.status,
        ])
        self.widget = W.VBox([controls, self.tree_box, self.text])

    # -- settings ---------------------------------------------------------------------------
    def _on_shape(self, change: Any = None) -> None:
        """Keep N valid for (S, K): a chain (K = 1) forces N = S + 1; a tree allows K·S + 1."""
        s, k = self.num_steps.value, self.topk.value
        if k == 1:
            self.num_draft_tokens.max = max(s + 1, 2)
            self.num_draft_tokens.value = s + 1
            self.num_draft_tokens.disabled = True
        else:
            self.num_draft_tokens.max = k * s + 1
            self.num_draft_tokens.disabled = not self.has_draft

    def _on_policy(self, change: Any = None) -> None:
        self.threshold.disabled = self.policy.value != "BatchThreshold" or not self.has_draft

    def make_policy(self) -> Policy:
        """The dropdown's policy: ``off`` is ``Never`` (draft kept warm, no speculation)."""
        if self.policy.value == "BatchThreshold":
            return BatchThreshold(int(self.threshold.value))
        return Never() if self.policy.value == "off" else Always()

    def spec_config(self) -> SpecConfig | None:
        """The SpecConfig the controls describe (None for an engine without a draft)."""
        if not self.has_draft:
            return None
        return SpecConfig(num_steps=self.num_steps.value, topk=self.topk.value,
                          num_draft_tokens=self.num_draft_tokens.value,
                          policy=self.make_policy())

    # -- driving the engine -----------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """True once the current request ended (or before the first step)."""
        return self.rid is None or self.engine.requests[self.rid].finished

    def _start(self) -> None:
        self.engine.set_spec(self.spec_config())
        sp = SamplingParams(max_new_tokens=int(self.max_new_tokens.value))
        self.rid = self.engine.add_request(self.prompt.value, sp)
        self.events = []
        self.reports = []

    def step(self, redraw: bool = True) -> StepReport:
        """Advance the request to its next verify step (or one plain step when the policy
        does not speculate); start a new request first if none is running."""
        if self.rid is None or self.finished:
            self._start()
        assert self.rid is not None
        self.engine.set_spec(self.spec_config())  # settings apply from this step on
        req = self.engine.requests[self.rid]
        before = len(req.output_ids)
        calls = 0
        verify: Verified | None = None
        while not req.finished and calls < 10_000:
            with trace(self.engine) as rec:
                self.engine.step()
            calls += 1
            self.events.extend(rec.events)
            mine = [e for e in rec.events if isinstance(e, Verified) and e.rid == self.rid]
            if mine:
                verify = mine[-1]
                break
            prefilled = any(isinstance(e, Prefill) and self.rid in e.rids for e in rec.events)
            if not prefilled and len(req.output_ids) > before:
                break  # a plain decode step (the policy did not speculate)
        report = StepReport(calls, verify.step if verify else None,
                            verify.accept_length if verify else None,
                            len(req.output_ids) - before, req.finished)
        self.reports.append(report)
        if redraw:
            self.redraw()
        return report

    def run(self) -> list[StepReport]:
        """Step until the request finishes; redraw once at the end."""
        reports = [self.step(redraw=False)]
        while not self.finished:
            reports.append(self.step(redraw=False))
        self.redraw()
        return reports

    def reset(self) -> None:
        """Abort the current request; the next step starts a new one from the prompt box."""
        if self.rid is not None:
            self.engine.abort(self.rid)
        self.rid = None
        self.events = []
        self.reports = []
        self._show(None, "press step to draft a tree")
        self.text.value = ""
        self._set_status("reset")

    def _guarded(self, fn: Any) -> None:
        """Button callbacks: a workbench error becomes the status line, not a traceback."""
        try:
            fn()
        except WorkbenchError as e:
            self._set_status(f"error: {e}", error=True)

    # -- drawing ----------------------------------------------------------------------------
    def tree_frame(self) -> pd.DataFrame:
        """``frame("tree")`` of everything this explorer recorded for its request."""
        df = frame(self.events, "tree")
        return df[df["rid"] == self.rid] if self.rid is not None else df.iloc[:0]

    def redraw(self) -> None:
        """Redraw the latest verified tree, the coloured text and the status line."""
        if self.rid is None:
            return
        tree = self.tree_frame()
        last = next((r.verify_step for r in reversed(self.reports)
                     if r.verify_step is not None), None)
        if last is not None and not tree.empty:
            self._show(figures.draft_tree(tree, last, self.rid,
                                          self.engine.tokenizer))
        else:
            self._show(None, "plain decoding: no draft tree this step")
        out = self.engine.output(self.rid)
        tok = self.engine.tokenizer
        prompt = self.prompt.value if tok is not None else ""
        self.text.value = figures.colored_html(out.token_ids, out.from_draft, tok, prompt)
        verifies = [r.accept_length for r in self.reports if r.accept_length is not None]
        mean = f"{sum(verifies) / len(verifies):.2f}" if verifies else "–"
        cur = self.reports[-1] if self.reports else None
        tau = "–" if cur is None or cur.accept_length is None else str(cur.accept_length)
        state = f"finished ({out.finish_reason})" if self.finished else "running"
        self._set_status(f"request {self.rid}: {len(out.token_ids)} tokens, {state} · "
                         f"this step τ = {tau} · mean τ = {mean} over {len(verifies)} "
                         f"verify steps")

    def _show(self, fig: go.Figure | None, message: str = "") -> None:
        """Put ``fig`` (a new FigureWidget) or the placeholder ``message`` into the box."""
        old = self.tree
        if fig is None:
            self.placeholder.value = self._message(message)
            self.tree = None
            self.tree_box.children = (self.placeholder,)
        else:
            self.tree = go.FigureWidget(fig)
            self.tree_box.children = (self.tree,)
        if old is not None:
            old.close()

    def _set_status(self, msg: str, error: bool = False) -> None:
        color = "#d62728" if error else "#333"
        self.status.value = f'<span style="color:{color};font:13px sans-serif">{msg}</span>'

    @staticmethod
    def _message(msg: str) -> str:
        return (f'<div class="wb-explorer-placeholder" style="font:14px sans-serif;color:#777;'
                f'padding:40px 0 40px 200px">{msg}</div>')

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


class SweepProgress:
    """Live progress for a sweep: a progress bar, the last row as text and (given ``x`` and
    ``y``) a live scatter of ``y`` against ``x``, one trace per value of ``color``.

        progress = SweepProgress(len(grid), "S × K × N", x="num_draft_tokens", y="tau",
                                 color="topk")
        progress                                   # display it
        for cfg in progress.iter(grid):
            progress.update(**measure(cfg))        # one row per configuration
        progress.frame()                           # all rows as a DataFrame
    """

    def __init__(self, total: int, title: str = "sweep", x: str | None = None,
                 y: str | None = None, color: str | None = None) -> None:
        self.total = total
        self.title = title
        self.x, self.y, self.color = x, y, color
        self.rows: list[dict[str, Any]] = []
        self.bar = W.IntProgress(value=0, min=0, max=max(total, 1), description=title,
                                 style={"description_width": "initial"})
        self.label = W.HTML()
        self.figure: go.FigureWidget | None = None
        parts: list[W.Widget] = [W.HBox([self.bar, self.label])]
        if x is not None and y is not None:
            fig = go.Figure()
            fig.update_layout(width=figures.WIDTH, height=360, template="plotly_white",
                              title=f"{title}: {figures.label(y)} vs {figures.label(x)}",
                              xaxis_title=figures.label(x), yaxis_title=figures.label(y),
                              legend_title_text=color or "")
            self.figure = go.FigureWidget(fig)
            parts.append(self.figure)
        self.widget = W.VBox(parts)

    def iter(self, items: Iterable[Any]) -> Iterator[Any]:
        """Yield ``items``; mark the bar finished at the end."""
        yield from items
        self.close()

    def update(self, **row: Any) -> None:
        """Record one finished item (its measurements as keyword arguments)."""
        self.rows.append(row)
        self.bar.value = min(len(self.rows), self.bar.max)
        shown = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in row.items())
        self.label.value = f"{len(self.rows)}/{self.total} · {shown}"
        if self.figure is not None and self.x in row and self.y in row:
            self._plot()

    def _plot(self) -> None:
        assert self.figure is not None
        key = self.color
        groups: dict[str, tuple[list[Any], list[Any]]] = {}
        for r in self.rows:
            if self.x not in r or self.y not in r:
                continue
            name = str(r.get(key)) if key else str(self.y)
            xs, ys = groups.setdefault(name, ([], []))
            xs.append(r[self.x])
            ys.append(r[self.y])
        with self.figure.batch_update():
            have = {t.name: t for t in self.figure.data}
            for name, (xs, ys) in groups.items():
                if name in have:
                    have[name].x, have[name].y = xs, ys
                else:
                    st = figures.arm_style(name, len(self.figure.data))
                    self.figure.add_scatter(x=xs, y=ys, name=name, mode="markers+lines",
                                            line=dict(color=st["color"], dash=st["dash"]))

    def close(self) -> None:
        """Mark the sweep finished (green bar) and freeze the live plot.

        A FigureWidget's saved state is the figure it was created with (later updates travel
        as messages), so an executed-then-exported notebook would show an empty plot. The live
        widget is therefore swapped for a fresh one created from the final figure.
        """
        self.bar.bar_style = "success"
        if self.figure is not None and self.rows:
            final = go.FigureWidget(self.figure)
            self.figure.close()
            self.figure = final
            self.widget.children = (*self.widget.children[:-1], final)

    def frame(self) -> pd.DataFrame:
        """The recorded rows."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
