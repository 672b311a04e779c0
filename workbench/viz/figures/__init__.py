"""Trace DataFrames → plotly figures. Every function returns a ``plotly.graph_objects.Figure``
with an explicit width/height, a title and axis labels, and takes the tidy frames of
:mod:`workbench.trace.frame` (``tracer.frame(kind)``) or a benchmark table.

One module per kind of question; every name below is importable from here
(``from workbench.viz import figures as F; F.draft_tree(...)``).

============================  ===============================================================
function                      input
============================  ===============================================================
**trees**                     one draft tree
``draft_tree``                ``frame("tree")``: one draft tree (step, rid), accepted path lit
``pick_tree``                 ``frame("verify")`` → (step, rid) of the longest/shortest/first
**acceptance**                how often drafts are accepted
``acceptance_by_depth``       ``frame("accept_by_depth")`` (optionally one group per ``by``)
``acceptance_vs_confidence``  ``frame("tree")``: acceptance rate vs the draft's own probability
``tau_histogram``             ``frame("verify")``: accept length τ per verify step (bonus incl.)
``accept_rate_by_position``   ``frame("verify")`` → α_d table (vLLM per-position, EAGLE n-α)
``alpha_by_position``         that table: α_d and conditional α per draft position
``training_curves``           ``train_draft`` summary ``history``: loss, per-step accuracy
**timing**                    where time goes
``phase_timeline``            ``frame("timing")`` or ``frame("timing_long")``: ms per step
``phase_breakdown``           ``frame("timing")``: mean ms per phase, spec vs plain steps
``policy_timeline``           ``frame("policy")``: decode batch, speculate or not, step time
``init_stages``               ``frame("init")``: engine init stages and their status
``warm_vs_cold``              ``bench.concurrency.switch_costs``: switching cost, warm vs cold
**speedup**                   benchmark tables as speedups
``speedup_heatmap``           any table with x, y, value (and an optional facet) columns
``speedup_bars``              ``run_spec_bench(...).summary``: tok/s ratio and τ per arm
``shape_speedups``            ``bench.shapes.run_shapes``: speedup by target shape
**concurrency**               arms under load
``concurrency_curves``        concurrency sweep table (see :data:`CONCURRENCY_COLUMNS`)
``crossovers``                the same table → concurrency where an arm falls below baseline
``resolved_crossovers``       …only where the intervals resolve it: (c_above, c_below) or None
``speedup_vs_batch``          per (arm, concurrency) speedup with ``_lo``/``_hi`` intervals
``latency_cdf``               latency samples (ms): empirical CDF per arm, p50/p99
**moe**                       MoE targets
``expert_coverage``           ``frame("expert_coverage")``: distinct experts vs tokens, uniform
``cost_ratio``                verify/decode cost ratio vs batch per target (+ the model's)
**text**                      generated text
``colored_text``              token ids + ``RequestOutput.from_draft``: text coloured by source
``colored_html``              the same as an HTML ``<pre>``
============================  ===============================================================

:mod:`~workbench.viz.figures.style` holds what they share: size defaults, one colour per
meaning (``ACCEPTED``, ``TARGET``, ...), one look per arm (``arm_style``), axis titles
(``label``) and the sanity-flag mark, and the interval rules every figure follows:
``interval_color`` (green/red only when the whole interval is on one side of 1×, else
``NEUTRAL``), ``log_ticks``/``tick_log_axis`` (log axes ticked 1, 2, 5, 10, 20 …) and
``percentile_text`` (n beside every percentile; no p99 from fewer than ``MIN_P99_SAMPLES``).
Tests read the figures' data (``fig.data``,
``fig.layout``), not pixels.
"""

from __future__ import annotations

from workbench.viz.figures.acceptance import (
    accept_rate_by_position,
    acceptance_by_depth,
    acceptance_vs_confidence,
    alpha_by_position,
    tau_histogram,
    training_curves,
)
from workbench.viz.figures.concurrency import (
    CONCURRENCY_COLUMNS,
    concurrency_curves,
    crossovers,
    latency_cdf,
    resolved_crossovers,
    speedup_vs_batch,
)
from workbench.viz.figures.moe import cost_ratio, expert_coverage
from workbench.viz.figures.speedup import shape_speedups, speedup_bars, speedup_heatmap
from workbench.viz.figures.style import (
    ACCEPTED,
    ARM_COLORS,
    ARM_STYLE,
    FASTER,
    FLAG_MARK,
    FONT,
    HEIGHT,
    LABELS,
    MIN_P99_SAMPLES,
    NEUTRAL,
    PHASE_COLORS,
    PLAIN,
    REJECTED,
    ROOT,
    SHORT,
    SLOWER,
    SPEC,
    TARGET,
    WIDTH,
    arm_style,
    interval_color,
    label,
    log_ticks,
    percentile_text,
    tick_log_axis,
)
from workbench.viz.figures.text import colored_html, colored_text
from workbench.viz.figures.timing import (
    init_stages,
    phase_breakdown,
    phase_timeline,
    policy_timeline,
    warm_vs_cold,
)
from workbench.viz.figures.trees import (
    accepted_path,
    draft_tree,
    pick_tree,
    token_label,
    tree_layout,
)

__all__ = [
    "ACCEPTED", "ARM_COLORS", "ARM_STYLE", "CONCURRENCY_COLUMNS", "FASTER", "FLAG_MARK", "FONT",
    "HEIGHT", "LABELS", "MIN_P99_SAMPLES", "NEUTRAL", "PHASE_COLORS", "PLAIN", "REJECTED", "ROOT",
    "SHORT", "SLOWER", "SPEC", "TARGET", "WIDTH", "interval_color", "log_ticks",
    "percentile_text", "resolved_crossovers", "tick_log_axis",
    "accept_rate_by_position", "acceptance_by_depth", "acceptance_vs_confidence", "cost_ratio",
    "expert_coverage",
    "accepted_path", "alpha_by_position", "arm_style", "colored_html", "colored_text",
    "concurrency_curves", "crossovers", "draft_tree", "init_stages", "label", "latency_cdf",
    "phase_breakdown", "phase_timeline", "pick_tree", "policy_timeline", "shape_speedups",
    "speedup_bars", "speedup_heatmap", "speedup_vs_batch", "tau_histogram", "token_label",
    "training_curves", "tree_layout", "warm_vs_cold",
]
