"""Figures are checked through their data (traces, axis ranges, the highlighted path), on
hand-built trees with known acceptance and on traces of a real micro-engine run."""

from __future__ import annotations

import json
import math

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import pytest

import workbench as wb
from workbench.trace import TreeBuilt, Verified
from workbench.trace.events import InitStage, PolicyDecision, StepTiming
from workbench.trace.frame import TIMING_PHASES, frame
from workbench.trace.tracer import RecordingTracer
from workbench.viz import figures as F


def by_name(fig: go.Figure) -> dict[str, go.BaseTraceType]:
    return {t.name: t for t in fig.data}


def assert_dressed(fig: go.Figure) -> None:
    """Explicit size, a title, and JSON that round-trips (what the notebooks store)."""
    assert fig.layout.width and fig.layout.height
    assert fig.layout.title.text
    assert json.loads(pio.from_json(fig.to_json()).to_json()) == json.loads(fig.to_json())


def hand_tree() -> list[TreeBuilt | Verified]:
    """K=2 tree (rid 7, step 1): accepted path 0→1→3, bonus 99.

    node:   0   1   2   3   4   5   6
    parent: -1  0   0   1   1   2   3
    """
    return [
        TreeBuilt(step=1, rid=7, tokens=[10, 11, 12, 13, 14, 15, 16],
                  parents=[-1, 0, 0, 1, 1, 2, 3], depth=[0, 1, 1, 2, 2, 2, 3],
                  scores=[0.0, -0.1, -2.0, -0.3, -1.5, -2.5, -0.9],
                  draft_probs=[1.0, 0.9, 0.1, 0.8, 0.2, 0.6, 0.5], t=1.0),
        Verified(step=1, rid=7, target_tokens=[11, 13, 30, 99, 40, 41, 42],
                 target_probs=[1.0, 0.95, 0.01, 0.7, 0.1, 0.2, 0.3], accepted_path=[0, 1, 3],
                 accepted_tokens=[11, 13, 99], accept_length=3, bonus_token=99, t=1.1),
        TreeBuilt(step=2, rid=8, tokens=[1, 2], parents=[-1, 0], depth=[0, 1],
                  scores=[0.0, -0.2], draft_probs=[1.0, 0.8], t=2.0),  # never verified
    ]


# ---- draft tree ------------------------------------------------------------------------------


def test_tree_layout_depth_and_rows() -> None:
    pos = F.tree_layout([-1, 0, 0, 1, 1, 2, 3])
    assert [p[0] for p in pos] == [0, 1, 1, 2, 2, 2, 3]
    leaves = {4: 1.0, 5: 2.0, 6: 0.0}  # depth-first leaf order: 6 (via 1→3), 4, 5
    for node, row in leaves.items():
        assert pos[node][1] == row
    assert pos[3][1] == pos[6][1]  # single child: same row
    assert pos[1][1] == (pos[3][1] + pos[4][1]) / 2
    assert pos[0][1] == (pos[1][1] + pos[2][1]) / 2
    deep = F.tree_layout([-1] + list(range(3000)))  # a long chain does not recurse
    assert deep[-1] == (3000.0, 0.0)


def test_draft_tree_highlights_the_accepted_path() -> None:
    fig = F.draft_tree(frame(hand_tree(), "tree"), step=1, rid=7)
    assert_dressed(fig)
    tr = by_name(fig)
    assert list(tr) == ["edges", "accepted path", "drafted, not accepted", "accepted",
                        "root (last verified token)", "bonus edge", "bonus (target)"]
    assert list(tr["accepted"].customdata) == [1, 3]
    assert list(tr["root (last verified token)"].customdata) == [0]
    assert list(tr["drafted, not accepted"].customdata) == [2, 4, 5, 6]
    assert list(tr["accepted"].text) == ["11", "13"]
    # Path segments: (0→1) and (1→3), each "x0, x1, None"; depth on x.
    assert list(tr["accepted path"].x) == [0, 1, None, 1, 2, None]
    assert sum(x is None for x in tr["edges"].x) == 6  # N - 1 edges
    # The bonus sits one level after the last accepted node (depth 2 → 3), on a row of its
    # own below every drafted node: never on top of a rejected sibling (node 6 is at (3, 0)).
    assert list(tr["bonus (target)"].x) == [3.0] and list(tr["bonus (target)"].text) == ["99"]
    drafted = [(x, y) for name in ("drafted, not accepted", "accepted",
                                   "root (last verified token)")
               for x, y in zip(tr[name].x, tr[name].y, strict=True)]
    assert tr["bonus (target)"].y[0] > max(y for _, y in drafted)
    assert (tr["bonus (target)"].x[0], tr["bonus (target)"].y[0]) not in drafted
    assert list(tr["bonus edge"].x) == [2.0, 3.0]  # from the last accepted node (depth 2)
    assert "τ = 3" in fig.layout.title.text and "7 nodes" in fig.layout.title.text
    lo, hi = fig.layout.xaxis.range
    assert lo < 0 and hi > 3  # room for the bonus column
    hover = tr["accepted"].hovertext[0]
    assert "draft p 0.900" in hover and "target p 0.950" in hover


def test_draft_tree_unverified_and_missing() -> None:
    df = frame(hand_tree(), "tree")
    fig = F.draft_tree(df, step=2, rid=8)
    assert "bonus (target)" not in by_name(fig)
    assert "not verified" in fig.layout.title.text
    assert list(by_name(fig)["accepted"].customdata) == []
    with pytest.raises(ValueError, match="no tree for step 9"):
        F.draft_tree(df, step=9, rid=7)
    with pytest.raises(ValueError, match="missing column"):
        F.draft_tree(df.drop(columns=["accepted"]), step=1, rid=7)


def test_draft_tree_matches_engine_verify(traced: tuple[RecordingTracer, list],
                                          engine: wb.Engine) -> None:
    rec, _ = traced
    tree, ver = rec.frame("tree"), rec.frame("verify")
    assert len(ver) > 0 and (ver["accept_length"] > 1).any(), "head never accepted a draft"
    for row in ver.itertuples():
        fig = F.draft_tree(tree, row.step, row.rid, engine.tokenizer)
        tr = by_name(fig)
        path = [0] + list(tr["accepted"].customdata)
        assert path == list(row.accepted_path)
        assert path == F.accepted_path(tree, row.step, row.rid)
        shown = sum(len(tr[n].x) for n in ("drafted, not accepted", "accepted",
                                           "root (last verified token)"))
        assert shown == row.n_nodes == 10
        assert tr["bonus (target)"].customdata[0] == -1
        assert f"τ = {row.accept_length}" in fig.layout.title.text
    step, rid = F.pick_tree(ver)
    assert ver[(ver.step == step) & (ver.rid == rid)].accept_length.iloc[0] == \
        ver.accept_length.max()
    assert F.pick_tree(ver, "first") == (int(ver.step.iloc[0]), int(ver.rid.iloc[0]))


def test_token_label_escapes_whitespace(engine: wb.Engine) -> None:
    nl = engine.tokenizer.encode("\n", add_special_tokens=False)[0]
    assert "⏎" in F.token_label(nl, engine.tokenizer)
    assert F.token_label(42) == "42"


# ---- acceptance and τ ------------------------------------------------------------------------


def test_acceptance_by_depth(traced: tuple[RecordingTracer, list]) -> None:
    rec, _ = traced
    df = rec.frame("accept_by_depth")
    fig = F.acceptance_by_depth(df)
    assert_dressed(fig)
    bars, line = fig.data
    assert list(bars.x) == list(df["depth"]) and list(bars.y) == pytest.approx(list(df["rate"]))
    assert list(line.y) == pytest.approx(list(df["tree_rate"]))
    assert tuple(fig.layout.yaxis.range) == (0, 1.05)
    two = pd.concat([df.assign(arm="a"), df.assign(arm="b")])
    fig2 = F.acceptance_by_depth(two, by="arm")
    assert [t.name for t in fig2.data] == ["a", "b"]


def test_acceptance_vs_confidence_counts_live_nodes() -> None:
    df = frame(hand_tree(), "tree")
    fig = F.acceptance_vs_confidence(df, bins=10)
    assert_dressed(fig)
    t = by_name(fig)
    # Nodes with an accepted parent: 1, 2 (root), 3, 4 (node 1), 6 (node 3) → 5 nodes.
    assert sum(t["nodes"].y) == 5
    rates = {round(x, 2): r for x, r in zip(t["acceptance"].x, t["acceptance"].y, strict=True)
             if r is not None}
    assert rates[0.85] == 1.0 and rates[0.15] == 0.0 and rates[0.55] == 0.0


def test_tau_histogram(traced: tuple[RecordingTracer, list]) -> None:
    rec, _ = traced
    ver = rec.frame("verify")
    fig = F.tau_histogram(ver)
    assert_dressed(fig)
    (bars,) = fig.data
    assert list(bars.x) == list(range(1, int(ver.accept_length.max()) + 1))
    assert sum(bars.y) == pytest.approx(1.0)
    assert sum(bars.customdata) == len(ver)
    assert f"{ver.accept_length.mean():.2f}" in fig.layout.title.text
    both = pd.concat([ver.assign(arm="x"), ver.assign(arm="y")])
    assert [t.name for t in F.tau_histogram(both, by="arm").data] == ["x", "y"]


# ---- time, policy, init ----------------------------------------------------------------------


def test_phase_timeline_wide_and_long_agree(traced: tuple[RecordingTracer, list]) -> None:
    rec, _ = traced
    wide, long = rec.frame("timing"), rec.frame("timing_long")
    a, b = F.phase_timeline(wide), F.phase_timeline(long)
    assert_dressed(a)
    assert a.layout.barmode == "stack"
    assert len(a.data) == len(TIMING_PHASES) == len(b.data)
    for ta, tb in zip(a.data, b.data, strict=True):
        assert ta.name == tb.name
        assert list(ta.y) == pytest.approx(list(tb.y))
    steps = list(a.data[0].x)
    assert steps == sorted(wide["step"])
    stacked = [sum(t.y[i] for t in a.data) for i in range(len(steps))]
    want = wide.sort_values("step")[[f"{p}_ms" for p in TIMING_PHASES]].sum(axis=1)
    assert stacked == pytest.approx(list(want))


def test_policy_timeline_marks_spec_and_plain() -> None:
    evs = [PolicyDecision(step=i, batch_size=b, decode_batch=b, speculate=b <= 2, num_steps=3,
                          topk=2, num_draft_tokens=6, reason="x", measured_ms=float(i), t=i)
           for i, b in enumerate([4, 4, 3, 2, 1, 1])]
    fig = F.policy_timeline(frame(evs, "policy"), threshold=2)
    assert_dressed(fig)
    t = by_name(fig)
    assert list(t["speculate"].x) == [3, 4, 5] and list(t["plain"].x) == [0, 1, 2]
    assert list(t["spec step ms"].y) == [3.0, 4.0, 5.0]
    assert [s.y0 for s in fig.layout.shapes] == [2.5]


def test_policy_timeline_on_engine_threshold(engine: wb.Engine) -> None:
    sps = [wb.SamplingParams(max_new_tokens=6 * (i + 1), ignore_eos=True) for i in range(4)]
    spec = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, policy=wb.BatchThreshold(2))
    with wb.trace(engine) as rec:
        engine.generate(["a = 1\n", "def f(x):", "import os\n", "class A:"], sps, spec=spec)
    pol = rec.frame("policy")
    fig = F.policy_timeline(pol, threshold=2)
    t = by_name(fig)
    assert all(y <= 2 for y in t["speculate"].y)
    assert len(t["speculate"].x) > 0 and len(t["plain"].x) > 0
    # plain at or below the threshold only where every request had one token left (a draft
    # cannot help it): the engine reports that step as plain
    low = pol[(~pol["speculate"]) & (pol["decode_batch"] <= 2)]
    assert low["reason"].str.endswith("ran plain").all()
    assert sorted(t["plain"].y) == sorted(pol[~pol["speculate"]]["decode_batch"])


def test_init_stages_colours_by_status() -> None:
    evs = [InitStage(stage="load_target", status="ok", seconds=0.5, t=0.0),
           InitStage(stage="load_draft", status="fallback", seconds=0.1, detail="boom", t=0.1),
           InitStage(stage="allocate_kv", status="ok", seconds=0.0, t=0.2)]
    fig = F.init_stages(frame(evs, "init"))
    assert_dressed(fig)
    t = by_name(fig)
    assert list(t["ok"].y) == ["load_target", "allocate_kv"]
    assert list(t["fallback"].customdata) == ["boom"]
    assert min(t["ok"].x) > 0  # a zero-second stage still shows
    assert list(fig.layout.yaxis.categoryarray) == ["allocate_kv", "load_draft", "load_target"]


# ---- benchmarks ------------------------------------------------------------------------------


def grid() -> pd.DataFrame:
    rows = [dict(num_steps=s, topk=k, num_draft_tokens=n, speedup=1 + 0.1 * s - 0.05 * k + n / 100)
            for s in (2, 4) for k in (1, 2) for n in (4, 8)]
    return pd.DataFrame(rows[:-1])  # one missing cell


def test_speedup_heatmap_facets_and_values() -> None:
    df = grid()
    fig = F.speedup_heatmap(df, x="topk", y="num_draft_tokens", value="speedup",
                            facet="num_steps")
    assert_dressed(fig)
    assert [t.type for t in fig.data] == ["heatmap", "heatmap"]
    s2, s4 = fig.data
    assert list(s2.x) == ["1", "2"] and list(s2.y) == ["4", "8"]
    # colour = log2(speedup): 0.5× and 2× equally far from 1×; the text is the speedup
    assert s2.z[0][1] == pytest.approx(math.log2(1 + 0.2 - 0.1 + 0.04))
    assert s4.z[1][1] is None  # the missing (S4, K2, N8) cell stays blank
    assert s2.text[0][0] == f"{2 ** s2.z[0][0]:.2f}×"
    assert s2.zmin + s2.zmax == pytest.approx(0.0)  # symmetric in log space around 1×
    ticks = list(s2.colorbar.ticktext)
    assert "1×" in ticks and not any(t.startswith("-") for t in ticks)  # never below 0×
    # axes and panels are titled in words, not column names
    assert fig.layout.xaxis.title.text == "K (top-k branching)"
    assert fig.layout.yaxis.title.text == "N (verified nodes)"
    assert [a.text for a in fig.layout.annotations] == ["S = 2", "S = 4"]
    flagged = df.assign(flags=["", "speedup_above_tau"] + [""] * (len(df) - 2))
    ff = F.speedup_heatmap(flagged, x="topk", y="num_draft_tokens", value="speedup",
                           facet="num_steps", flag="flags")
    assert sum("⚠" in t for row in ff.data[0].text for t in row) == 1
    assert "sanity flag" in ff.layout.title.text
    flat = F.speedup_heatmap(df, x="topk", y="num_steps", value="speedup", zmid=None)
    assert len(flat.data) == 1 and flat.data[0].colorscale[0][1] != s2.colorscale[0][1]


def test_speedup_bars() -> None:
    summary = pd.DataFrame({"arm": ["baseline", "chain", "tree"], "speedup": [1.0, 1.3, 0.8],
                            "tau": [1.0, 2.5, 3.0], "tok_s": [100.0, 130.0, 80.0]})
    fig = F.speedup_bars(summary)
    assert_dressed(fig)
    t = by_name(fig)
    assert list(t["speedup"].y) == [1.0, 1.3, 0.8] and list(t["τ"].y) == [1.0, 2.5, 3.0]
    assert list(t["speedup"].text) == ["1×", "1.30×", "0.80×"]
    # τ in its own panel: the 1.0× line (a shape on the speedup axis) cannot read as a τ
    assert t["τ"].xaxis == "x2" and t["τ"].yaxis == "y2"
    assert [(sh.yref, sh.y0) for sh in fig.layout.shapes] == [("y", 1.0)]
    assert not fig.layout.showlegend  # colours are explained by the panel titles
    # no intervals: a point estimate alone colours no side
    assert list(t["speedup"].marker.color) == [F.PLAIN, F.NEUTRAL, F.NEUTRAL]


def test_speedup_bars_colour_from_the_interval_and_flags_on_the_figure() -> None:
    summary = pd.DataFrame({
        "arm": ["baseline", "win", "straddles", "loses"], "speedup": [1.0, 1.3, 1.66, 0.8],
        "speedup_lo": [1.0, 1.1, 0.75, 0.7], "speedup_hi": [1.0, 1.5, 3.65, 0.9],
        "n": [4, 4, 4, 4], "tau": [1.0, 2.5, 3.0, 2.0],
        "flags": ["", "", "loaded", "speedup_above_tau"]})
    t = by_name(F.speedup_bars(summary))
    # 1.66× [0.75–3.65] straddles 1×: neutral, though its point is the highest
    assert list(t["speedup"].marker.color) == [F.PLAIN, F.FASTER, F.NEUTRAL, F.SLOWER]
    texts = list(t["speedup"].text)
    assert "[0.75–3.65]" in texts[2] and "n = 4" in texts[2]
    assert "⚠ loaded" in texts[2] and "⚠ speedup_above_tau" in texts[3] and "⚠" not in texts[1]


def test_shape_speedups() -> None:
    df = pd.DataFrame({"shape": ["18x256", "72x256"], "speedup": [1.8, 2.5],
                       "bound": [3.1, 3.3], "verify_ratio": [1.5, 1.4]})
    fig = F.shape_speedups(df)
    assert_dressed(fig)
    t = by_name(fig)
    assert list(t["speedup"].y) == [1.8, 2.5] and list(t["speedup"].text) == ["1.80×", "2.50×"]
    assert list(t["bound: free drafting"].y) == [3.1, 3.3]
    assert list(t["verify / plain step"].y) == [1.5, 1.4]
    assert fig.layout.yaxis.range[1] >= 3.3  # the bound stays in view
    # the verify ratio has its own panel and axis (no twin axis, no unexplained line)
    assert t["verify / plain step"].xaxis == "x2" and not fig.layout.shapes
    with pytest.raises(ValueError, match="shape_speedups"):
        F.shape_speedups(df.drop(columns=["bound"]))


def concurrency_table(seconds: bool = False) -> pd.DataFrame:
    rows = []
    for c in (1, 2, 4, 8, 16):
        rows.append(dict(arm="baseline", concurrency=c, tok_s=100.0 * c, itl_p50_ms=10.0,
                         ttft_p50_ms=20.0, ttft_p99_ms=30.0, itl_p99_ms=12.0, tau=1.0,
                         spec_share=0.0))
        rows.append(dict(arm="eagle3", concurrency=c, tok_s=250.0 * c ** 0.5, itl_p50_ms=8.0,
                         ttft_p50_ms=21.0, ttft_p99_ms=31.0, itl_p99_ms=9.0, tau=2.5,
                         spec_share=1.0))
    df = pd.DataFrame(rows)
    if seconds:
        df = df.drop(columns=["itl_p50_ms", "ttft_p50_ms"]).assign(
            itl_p50=df["itl_p50_ms"] / 1e3, ttft_p50=df["ttft_p50_ms"] / 1e3)
    return df


def test_crossovers_interpolate_in_log2() -> None:
    # eagle3 - baseline: c=4: 500-400=+100, c=8: 707-800=-93 → crossover between 4 and 8
    got = F.crossovers(concurrency_table())["eagle3"]
    d0, d1 = 500.0 - 400.0, 250 * 8 ** 0.5 - 800.0
    assert got == pytest.approx(2 ** (2 + d0 / (d0 - d1)))
    never = concurrency_table().assign(tok_s=lambda d: d.tok_s + (d.arm == "eagle3") * 1e6)
    assert F.crossovers(never) == {"eagle3": None}
    with pytest.raises(ValueError, match="baseline arm"):
        F.crossovers(concurrency_table(), baseline="nope")


def test_concurrency_curves_accepts_bench_columns() -> None:
    df = concurrency_table()
    fig = F.concurrency_curves(df)
    assert_dressed(fig)
    t = by_name(fig)
    assert list(t["baseline"].x) == [1, 2, 4, 8, 16]
    assert list(t["eagle3"].y) == pytest.approx(list(df[df.arm == "eagle3"].tok_s))
    assert list(t["eagle3 ITL"].y) == [8.0] * 5 and list(t["eagle3 TTFT"].y) == [21.0] * 5
    assert fig.layout.xaxis.type == "log"
    assert F.crossovers(df)["eagle3"] == pytest.approx(5.7295, abs=1e-3)  # the point estimate
    # …but without intervals the figure draws no crossover, and says why
    assert not fig.layout.shapes
    assert any("crossover not resolved" in a.text for a in fig.layout.annotations)
    secs = F.concurrency_curves(concurrency_table(seconds=True))
    assert list(by_name(secs)["eagle3 ITL"].y) == pytest.approx([8.0] * 5)
    with pytest.raises(ValueError, match="tok_s"):
        F.concurrency_curves(df.drop(columns=["tok_s"]))


def test_training_curves() -> None:
    hist = [{"step": 10, "loss": 2.0, "acc": [0.3, 0.2]},
            {"step": 20, "loss": 1.5, "acc": [0.5, 0.3]}]
    fig = F.training_curves(hist)
    assert_dressed(fig)
    assert [t.name for t in fig.data] == ["loss", "acc step 0", "acc step 1"]
    assert list(fig.data[2].y) == [0.2, 0.3]


# ---- text ------------------------------------------------------------------------------------


def test_colored_text_partitions_tokens(traced: tuple[RecordingTracer, list],
                                        engine: wb.Engine) -> None:
    _, outs = traced
    out = outs[2]
    assert any(out.from_draft) and not all(out.from_draft)
    fig = F.colored_text(out.token_ids, out.from_draft, engine.tokenizer, wrap=40)
    assert_dressed(fig)
    drafted, target = fig.data
    assert (drafted.name, target.name) == ("from accepted drafts", "from the target")
    idx_d = {c[0] for c in drafted.customdata}
    idx_t = {c[0] for c in target.customdata}
    assert not idx_d & idx_t
    assert idx_d <= {i for i, d in enumerate(out.from_draft) if d}
    assert idx_t <= {i for i, d in enumerate(out.from_draft) if not d}
    # Every non-whitespace character is shown exactly once.
    shown = "".join(drafted.text) + "".join(target.text)
    assert sorted(shown.replace("\u00a0", "").replace(" ", "")) == \
        sorted("".join(out.text.split()))
    assert max(drafted.x + target.x) <= 40
    share = sum(out.from_draft) / len(out.from_draft)
    assert f"{share:.0%}" in fig.layout.title.text
    html = F.colored_html(out.token_ids, out.from_draft, engine.tokenizer, prompt="P")
    assert html.count("border-bottom") == sum(out.from_draft)
    with pytest.raises(ValueError, match="flags"):
        F.colored_text([1, 2], [True], engine.tokenizer)


def test_colored_text_without_tokenizer() -> None:
    fig = F.colored_text([5, 6, 7], [True, True, False])
    assert list(fig.data[0].text) == ["[5]", "[6]"] and list(fig.data[1].text) == ["[7]"]


def test_step_timing_event_fields_cover_phases() -> None:
    # phase_timeline relies on TIMING_PHASES naming StepTiming's *_ms fields
    names = set(StepTiming.__dataclass_fields__)
    assert all(f"{p}_ms" in names for p in TIMING_PHASES)
    assert not math.isnan(StepTiming(step=0, batch_size=1, mode="plain").total_ms)


def test_warm_vs_cold() -> None:
    df = pd.DataFrame({"concurrency": [1, 4], "warm_switch_extra_ms": [0.1, 0.2],
                       "cold_switch_extra_ms": [1.0, 2.0], "warm_plain_ms": [3.0, 4.0],
                       "cold_plain_ms": [2.0, 3.0]})
    fig = F.warm_vs_cold(df)
    assert_dressed(fig)
    t = {(tr.name, tr.meta): tr for tr in fig.data}
    assert list(t) == [("warm draft", "switch"), ("cold draft", "switch"),
                       ("warm draft", "plain"), ("cold draft", "plain")]
    assert list(t[("cold draft", "switch")].y) == [1.0, 2.0]
    assert list(t[("warm draft", "plain")].x) == ["1", "4"]
    assert [tr.showlegend for tr in fig.data] == [True, True, False, False]


def test_concurrency_curves_x_range_covers_levels_only() -> None:
    fig = F.concurrency_curves(concurrency_table())
    lo, hi = fig.layout.xaxis.range
    assert lo < 0 < math.log10(16) < hi < math.log10(32)  # log10 units, annotations excluded
    assert tuple(fig.layout.xaxis2.range) == (lo, hi)


def test_concurrency_curves_separate_log_latency_axes_and_one_label() -> None:
    df = pd.concat([concurrency_table(), concurrency_table().assign(
        arm="never", tok_s=lambda d: d.tok_s * 0.5)], ignore_index=True)
    fig = F.concurrency_curves(df)
    t = by_name(fig)
    assert t["eagle3 ITL"].yaxis == "y2" and t["eagle3 TTFT"].yaxis == "y3"
    assert fig.layout.yaxis2.type == "log" and fig.layout.yaxis3.type == "log"
    # only the marked arm (eagle3) gets a crossover label, though never also crosses
    assert sum("crossover" in a.text for a in fig.layout.annotations) == 1
    assert [tr.name for tr in fig.data if tr.xaxis == "x"][-1] == "baseline"  # drawn on top
    assert t["baseline"].line.color != t["never"].line.color
    assert t["never"].line.dash == "dash" and t["baseline"].name == "baseline"


def test_speedup_vs_batch_error_bars_and_flags() -> None:
    df = pd.DataFrame({"arm": ["eagle3"] * 3, "concurrency": [1, 2, 4],
                       "vs_baseline": [1.5, 1.1, 0.9], "vs_baseline_lo": [1.4, 1.0, 0.7],
                       "vs_baseline_hi": [1.6, 1.2, 1.1], "n": [3, 3, 3],
                       "flags": ["", "", "never_vs_baseline"]})
    fig = F.speedup_vs_batch(df)
    assert_dressed(fig)
    (tr,) = fig.data
    assert list(tr.error_y.array) == pytest.approx([0.1, 0.1, 0.2])
    assert list(tr.marker.symbol) == ["circle", "circle", "circle-dot"]


def test_latency_cdf_and_percentiles() -> None:
    samples = pd.DataFrame({"arm": ["baseline"] * 100 + ["eagle3"] * 100,
                            "itl_ms": list(range(1, 101)) + [x / 2 for x in range(1, 101)]})
    fig = F.latency_cdf(samples, "itl_ms")
    assert_dressed(fig)
    lines = [t for t in fig.data if t.mode == "lines"]
    assert [t.name.split(" (")[0] for t in lines] == ["eagle3", "baseline"]
    assert list(lines[1].y)[-1] == 1.0 and fig.layout.xaxis.type == "log"
    assert "p99 99.0" in lines[1].name


def test_accept_rate_by_position_matches_vllm_counts() -> None:
    verify = pd.DataFrame({"accept_length": [1, 2, 4, 3], "cat": ["a", "a", "b", "b"]})
    a = F.accept_rate_by_position(verify)
    # accepted draft tokens per step: 0, 1, 3, 2 → positions reached: 1: 3, 2: 2, 3: 1
    assert a.accepted.tolist() == [3, 2, 1] and a.drafts.tolist() == [4, 4, 4]
    assert a.alpha.tolist() == pytest.approx([0.75, 0.5, 0.25])
    assert a.alpha_cond.tolist() == pytest.approx([0.75, 2 / 3, 0.5])
    # τ = 1 + Σ_d α_d (the accepted tokens per step plus the bonus)
    assert 1 + a.alpha.sum() == pytest.approx(verify.accept_length.mean())
    g = F.accept_rate_by_position(verify, by="cat")
    assert g[g.cat == "a"].accepted.tolist() == [1, 0, 0]
    fig = F.alpha_by_position(g, by="cat")
    assert_dressed(fig)
    assert [t.name for t in fig.data] == ["a α", "a α|prev", "b α", "b α|prev"]


def test_phase_breakdown_means(traced: tuple[RecordingTracer, list]) -> None:
    rec, _ = traced
    timing = rec.frame("timing")
    fig = F.phase_breakdown(timing)
    assert_dressed(fig)
    t = by_name(fig)
    spec = timing[timing["mode"] == "spec"]
    idx = [y.split(" (")[0] for y in t["draft"].y].index("spec")
    assert t["draft"].x[idx] == pytest.approx(spec["draft_ms"].mean())


def test_log_ticks_read_as_real_values() -> None:
    vals, text = F.log_ticks(1.3, 420)
    # from the tick at or below the lowest value to the one at or above the highest
    assert vals == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert text == ["1", "2", "5", "10", "20", "50", "100", "200", "500"]
    assert vals == sorted(vals)  # never "2, 5, 100, 2, 5"
    assert F.log_ticks(0.4, 3000)[1] == ["0.2", "0.5", "1", "2", "5", "10", "20", "50", "100",
                                         "200", "500", "1k", "2k", "5k"]
    assert F.log_ticks(3.1, 3.4)[0] == [2, 5]  # a narrow range still gets two ticks
    assert F.log_ticks(20, 50)[0] == [20, 50]


def test_concurrency_curves_latency_axes_ticked_with_values() -> None:
    fig = F.concurrency_curves(concurrency_table())
    for ax in (fig.layout.yaxis2, fig.layout.yaxis3):
        assert ax.type == "log" and list(ax.tickvals) == sorted(ax.tickvals)
        assert all(float(v) / 10 ** math.floor(math.log10(v)) in (1, 2, 5) for v in ax.tickvals)


def test_crossover_drawn_only_where_the_intervals_resolve_it() -> None:
    df = concurrency_table()
    ratio = pd.DataFrame({"arm": ["eagle3"] * 3, "concurrency": [1, 4, 16],
                          "ratio": [1.5, 1.0, 0.6], "ratio_lo": [1.2, 0.5, 0.5],
                          "ratio_hi": [1.8, 1.6, 0.7]})
    fig = F.concurrency_curves(df, ratio=ratio)
    (label,) = [a.text for a in fig.layout.annotations if "eagle3" in a.text]
    assert "between c=1 and 16" in label
    assert [s.type for s in fig.layout.shapes] == ["rect"]  # a band, not a point
    # the intervals span 0 to 373,817 tok/s: no crossover is claimed
    wide = ratio.assign(ratio_lo=0.01, ratio_hi=100.0)
    fig = F.concurrency_curves(df, ratio=wide)
    (label,) = [a.text for a in fig.layout.annotations if "eagle3" in a.text]
    assert "not resolved at this noise" in label and not fig.layout.shapes
    # no intervals at all: no line either
    assert not F.concurrency_curves(df).layout.shapes
    assert F.resolved_crossovers(df) == {"eagle3": None}


def test_latency_cdf_shows_n_and_no_p99_from_few_samples() -> None:
    samples = pd.DataFrame({"arm": ["baseline"] * 8 + ["eagle3"] * 150,
                            "itl_ms": list(range(1, 9)) + [x / 3 for x in range(1, 151)]})
    fig = F.latency_cdf(samples, "itl_ms")
    lines = {t.name.split(" (")[0]: t for t in fig.data if t.mode == "lines"}
    assert "(n = 8)" in lines["baseline"].name and "p99 n/a (< 100)" in lines["baseline"].name
    assert "(n = 150)" in lines["eagle3"].name and "p99 49.5 ms" in lines["eagle3"].name
    marks = {t.legendgroup: t for t in fig.data if t.mode == "markers"}
    assert len(marks["baseline"].x) == 1 and len(marks["eagle3"].x) == 2  # no p99 marker
    assert list(fig.layout.xaxis.ticktext)[:3] == ["0.2", "0.5", "1"]
    lo, hi = fig.layout.xaxis.range  # the end ticks are inside the axis
    assert lo < math.log10(0.2) and hi > math.log10(50)


def test_speedup_vs_batch_markers_neutral_when_straddling() -> None:
    df = pd.DataFrame({"arm": ["eagle3"] * 3, "concurrency": [1, 2, 4],
                       "vs_baseline": [1.5, 1.1, 0.6], "vs_baseline_lo": [1.4, 0.9, 0.5],
                       "vs_baseline_hi": [1.6, 1.2, 0.7], "n": [3, 3, 3],
                       "flags": ["", "loaded", ""]})
    (tr,) = F.speedup_vs_batch(df).data
    assert list(tr.marker.color) == [F.FASTER, F.NEUTRAL, F.SLOWER]
    assert list(tr.text) == ["n=3", "n=3 ⚠", "n=3"]
    assert "sanity flag: loaded" in F.speedup_vs_batch(df).layout.title.text


def test_warm_vs_cold_flags_negative_switch_costs() -> None:
    df = pd.DataFrame({"concurrency": [1, 4], "warm_switch_extra_ms": [0.1, -900.0],
                       "cold_switch_extra_ms": [1.0, 2.0], "warm_plain_ms": [3.0, 4.0],
                       "cold_plain_ms": [2.0, 3.0]})
    fig = F.warm_vs_cold(df)
    warm = next(t for t in fig.data if t.name == "warm draft" and t.meta == "switch")
    assert "⚠" in warm.text[1] and "⚠" not in warm.text[0]
    assert "below 0 ms" in fig.layout.title.text


def test_speedup_heatmap_neutral_where_the_interval_straddles() -> None:
    df = pd.DataFrame({"topk": [1, 2], "num_draft_tokens": [4, 4], "speedup": [1.4, 1.2],
                       "lo": [1.1, 0.8], "hi": [1.7, 1.6]})
    fig = F.speedup_heatmap(df, x="topk", y="num_draft_tokens", value="speedup", lo="lo",
                            hi="hi")
    (h,) = fig.data
    assert h.z[0][0] == pytest.approx(math.log2(1.4)) and h.z[0][1] == 0.0
    assert "[0.80–1.60]" in h.text[0][1] and "not resolved" in fig.layout.title.text
