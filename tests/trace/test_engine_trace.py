"""The engine's trace against the engine's own state: one recorded greedy run, checked event by
event (tokens, trees, step timing, request lifecycle, frames, JSONL), plus the hook error policy
on a live engine (isolated hooks; a fatal hook leaves the engine consistent).

Runs are greedy S5 K4 N16 on the micro target with staggered arrivals; the policy is Always or
RandomFlip (plain and speculative steps interleaved).
"""

from __future__ import annotations

import copy
import math
import random
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from helpers import id_prompts, make_engine

import workbench as wb
from workbench.engine.engine import EngineStats
from workbench.trace import (
    DraftExtended,
    DraftStep,
    Event,
    HookError,
    HookFailed,
    PolicyDecision,
    Prefill,
    RecordingTracer,
    RequestAdmitted,
    RequestFinished,
    StepTiming,
    TreeBuilt,
    Verified,
    read_jsonl,
    write_jsonl,
)

TRACE_CONFIG = wb.EngineConfig(kv_budget_tokens=4096, self_check=False)
SPEC = dict(num_steps=5, topk=4, num_draft_tokens=16)
# request i arrives before step ARRIVALS[i] (0-based): staggered, two at once at the end
ARRIVALS = (0, 1, 1, 3, 4)
MAX_NEW = (24, 9, 17, 30, 12)  # uneven, so the last verify of a request is often cut short


def arrival_prompts() -> list[list[int]]:
    """One random id prompt (4-29 tokens) per arrival."""
    return id_prompts(len(ARRIVALS), lo=4, hi=30)


def sampling() -> list[wb.SamplingParams]:
    return [wb.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]


def make_spec(policy: str) -> wb.SpecConfig:
    pol = wb.RandomFlip(p=0.5, seed=3) if policy == "flip" else wb.Always()
    return wb.SpecConfig(**SPEC, policy=pol)


@dataclass
class StepSlice:
    """What one ``engine.step()`` emitted and returned."""

    events: list[Event]
    deltas: dict[int, list[int]]  # rid -> new_token_ids
    finished: set[int]


@dataclass
class Run:
    rids: list[int]
    outputs: list[wb.RequestOutput]  # in prompt order
    steps: list[StepSlice]
    admitted: list[Event]  # events emitted by add_request (between steps)

    @property
    def tokens(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]


def drive(engine: wb.Engine, spec: wb.SpecConfig | None, rec: RecordingTracer | None = None,
          on_step: Callable[[], None] | None = None) -> Run:
    """Add the requests at their ARRIVALS and step until all finish; slices ``rec``'s events."""
    ps, sps = arrival_prompts(), sampling()
    engine.set_spec(spec)
    rids: list[int] = []
    steps: list[StepSlice] = []
    admitted: list[Event] = []

    def recorded() -> int:
        return 0 if rec is None else len(rec.events)

    try:
        k = 0
        while len(rids) < len(ps) or engine.has_unfinished():
            n0 = recorded()
            for i, arrival in enumerate(ARRIVALS):
                if arrival == k:
                    rids.append(engine.add_request(ps[i], sps[i]))
            if rec is not None:
                admitted += rec.events[n0:]
            n0 = recorded()
            outs = engine.step()
            if on_step is not None:
                on_step()
            evs = [] if rec is None else rec.events[n0:]
            steps.append(StepSlice(evs, {o.rid: o.new_token_ids for o in outs},
                                   {o.rid for o in outs if o.finished}))
            k += 1
    finally:
        engine.set_spec(None)
    return Run(rids, [engine.output(r) for r in rids], steps, admitted)


@dataclass
class Recorded:
    engine: wb.Engine
    run: Run
    rec: RecordingTracer
    stats: EngineStats  # a copy taken right after the recorded run
    policy: str


@pytest.fixture(scope="module", params=[("trained_head", "always"), ("trained_head", "flip"),
                                        ("random_head", "always")],
                ids=["trained-always", "trained-flip", "random-always"])
def recorded(request: pytest.FixtureRequest, micro_target: Path) -> Iterator[Recorded]:
    head_name, policy = request.param
    engine = make_engine(micro_target, request.getfixturevalue(head_name), TRACE_CONFIG)
    with wb.trace(engine) as rec:
        run = drive(engine, make_spec(policy), rec)
    yield Recorded(engine, run, rec, copy.deepcopy(engine.stats), policy)
    engine.close()


@pytest.fixture(scope="module")
def reference(micro_target: Path) -> list[list[int]]:
    """Greedy outputs of the plain target (no draft, no tracer), same arrivals."""
    engine = make_engine(micro_target, self_check=False)
    try:
        return drive(engine, None).tokens
    finally:
        engine.close()


def of(evs: list[Event], cls: type[Event]) -> list[Any]:
    return [e for e in evs if isinstance(e, cls)]


# ---- tokens --------------------------------------------------------------------------------


def test_outputs_are_lossless_with_tracing_on(recorded: Recorded,
                                               reference: list[list[int]]) -> None:
    assert recorded.run.tokens == reference
    assert recorded.stats.steps["spec"] > 0
    if recorded.policy == "flip":
        assert recorded.stats.steps["plain"] > 0, "RandomFlip was meant to mix plain steps in"


def test_verified_tokens_rebuild_every_output(recorded: Recorded) -> None:
    """Per request: first token (prefill) + per step Verified.accepted_tokens or the plain
    step's token == the output; only a request's last Verified may run past its end."""
    run = recorded.run
    rebuilt: dict[int, list[int]] = {r: [] for r in run.rids}
    uncovered: Counter[int] = Counter()  # tokens that came from prefill or plain steps
    drafted: Counter[int] = Counter()  # output tokens that were accepted draft tokens
    for s in run.steps:
        ver = {v.rid: v for v in of(s.events, Verified)}
        timing = of(s.events, StepTiming)
        for rid, delta in s.deltas.items():
            v = ver.pop(rid, None)
            if v is None:
                assert len(delta) == 1, (rid, delta)  # prefill's first token or a plain step
                prefilled = any(rid in p.rids for p in of(s.events, Prefill))
                # ... or, in a speculative step, a request's last token (decoded plainly: a
                # draft cannot help it), which finishes it
                assert prefilled or timing[0].mode == "plain" or rid in s.finished, rid
                uncovered[rid] += 1
                rebuilt[rid] += delta
                continue
            toks = v.accepted_tokens
            if rid in s.finished:  # max_new_tokens may cut the step's tokens short
                assert delta == toks[: len(delta)] and delta, (rid, delta, toks)
            else:
                assert delta == toks, (rid, delta, toks)
            rebuilt[rid] += toks[: len(delta)]
            drafted[rid] += min(len(delta), len(toks) - 1)
        assert not ver, f"Verified for requests that got no tokens: {sorted(ver)}"
    for out in run.outputs:
        assert rebuilt[out.rid] == out.token_ids
        assert uncovered[out.rid] == 1 + out.metrics.plain_steps
        assert sum(out.from_draft) == drafted[out.rid]


def test_tree_built_is_the_tree_the_verifier_used(recorded: Recorded) -> None:
    run, n_nodes = recorded.run, SPEC["num_draft_tokens"]
    context = {r: list(o.prompt_ids) for r, o in zip(run.rids, run.outputs, strict=True)}
    n_trees = 0
    for s in run.steps:
        trees = {(t.step, t.rid): t for t in of(s.events, TreeBuilt)}
        vers = {(v.step, v.rid): v for v in of(s.events, Verified)}
        assert trees.keys() == vers.keys()
        drafts = of(s.events, DraftStep)
        for key, t in trees.items():
            v = vers[key]
            n_trees += 1
            n = len(t.tokens)
            assert n == n_nodes == len(v.target_tokens) == len(v.target_probs)
            assert len(t.parents) == len(t.depth) == len(t.scores) == len(t.draft_probs) == n
            # tree shape: root first, parents before children, depth = parent's + 1
            assert t.parents[0] == -1 and t.depth[0] == 0 and t.scores[0] == 0.0
            assert t.tokens[0] == context[t.rid][-1], "root is the last verified token"
            for j in range(1, n):
                assert 0 <= t.parents[j] < j and t.depth[j] == t.depth[t.parents[j]] + 1
            assert max(t.depth) <= SPEC["num_steps"]
            # every drafted node is a candidate of that step's DraftStep at its depth
            for d in range(1, max(t.depth) + 1):
                ds = [e for e in drafts if e.step == t.step and e.depth == d]
                assert len(ds) == 1
                cands = set(ds[0].tokens[ds[0].rids.index(t.rid)])
                assert {t.tokens[j] for j in range(n) if t.depth[j] == d} <= cands
            # the accepted path is a root-to-node chain of this tree
            path = v.accepted_path
            edges = list(zip(path[:-1], path[1:], strict=True))
            assert path[0] == 0
            assert all(t.parents[b] == a for a, b in edges)
            assert [t.tokens[j] for j in path[1:]] == v.accepted_tokens[:-1]
            assert v.accept_length == len(v.accepted_tokens) == len(path)
            # greedy: each accepted node is the target's argmax after its parent; the bonus is
            # the argmax after the last accepted node, and no child of it matches that
            assert all(v.target_tokens[a] == t.tokens[b] for a, b in edges)
            assert v.bonus_token == v.accepted_tokens[-1] == v.target_tokens[path[-1]]
            children = [j for j in range(n) if t.parents[j] == path[-1]]
            assert all(t.tokens[j] != v.bonus_token for j in children)
            assert v.target_probs[0] == 1.0
            assert all(0.0 <= p <= 1.0 for p in v.target_probs)
        for rid, delta in s.deltas.items():
            context[rid] += delta
    assert n_trees == recorded.stats.verify_ct > 0


# ---- request lifecycle ---------------------------------------------------------------------


def test_every_request_is_admitted_once_and_finished_once(recorded: Recorded) -> None:
    run, evs = recorded.run, recorded.rec.events
    admitted = of(evs, RequestAdmitted)
    finished = of(evs, RequestFinished)
    assert sorted(e.rid for e in admitted) == sorted(run.rids)
    assert sorted(e.rid for e in finished) == sorted(run.rids)
    assert all(e in run.admitted for e in admitted), "admitted by add_request, not by a step"
    for out, sp in zip(run.outputs, sampling(), strict=True):
        a = next(e for e in admitted if e.rid == out.rid)
        f = next(e for e in finished if e.rid == out.rid)
        assert evs.index(a) < evs.index(f)
        assert (a.prompt_len, a.max_new_tokens, a.temperature) == (
            len(out.prompt_ids), sp.max_new_tokens, 0.0)
        assert (f.reason, f.prompt_len, f.output_len, f.error) == (
            out.finish_reason, len(out.prompt_ids), len(out.token_ids), "")
        assert f.verify_ct == out.metrics.verify_ct
        assert f.accept_lengths == out.metrics.accept_lengths
        assert 0.0 < f.ttft_s <= f.e2e_s
        # nothing of the request after it finished
        assert not [e for e in evs[evs.index(f) + 1:] if getattr(e, "rid", None) == out.rid]


# ---- step timing -----------------------------------------------------------------------------


def phase_sum(t: StepTiming) -> float:
    return t.schedule_ms + t.prefill_ms + t.draft_ms + t.verify_ms + t.decode_ms + t.accept_ms + \
        t.commit_ms + t.extend_ms


def check_step_timing(steps: list[StepSlice], tol: float = 0.05) -> list[StepTiming]:
    """The phases of a decode step lie inside it (never more than total_ms) and cover it to
    within ``tol``: over the run, and step by step save one step plus one in ten (on a loaded
    machine an OS time slice, tens of ms, can land in the few statements between two timers)."""
    timings = []
    for s in steps:
        ts, pds = of(s.events, StepTiming), of(s.events, PolicyDecision)
        if not ts:  # a prefill-only step has no decode batch, hence no StepTiming
            assert not pds and not of(s.events, Verified)
            continue
        (t,) = ts
        (pd_,) = pds
        timings.append(t)
        assert pd_.step == t.step and pd_.measured_ms == t.total_ms
        assert pd_.decode_batch == t.batch_size
        phases = [t.schedule_ms, t.prefill_ms, t.draft_ms, t.verify_ms, t.decode_ms, t.accept_ms,
                  t.commit_ms, t.extend_ms]
        assert all(p >= 0.0 for p in phases), t
        assert phase_sum(t) <= t.total_ms * (1 + 1e-9), t
        vers = of(s.events, Verified)
        n_ver = len(vers)
        if t.mode == "spec":
            # every decode request verified, except ones decoding their last token plainly
            ver_rids = {v.rid for v in vers}
            last = [r for r, d in s.deltas.items()
                    if r not in ver_rids and r in s.finished and len(d) == 1]
            assert pd_.speculate and n_ver >= 1 and n_ver + len(last) == t.batch_size
            assert t.draft_ms > 0 and t.verify_ms > 0
        else:
            assert t.mode == "plain" and n_ver == 0
            assert t.draft_ms == t.verify_ms == t.accept_ms == 0.0
        # prefill run in a decode step is its prefill_ms
        prefill_ms = 1e3 * sum(p.seconds for p in of(s.events, Prefill))
        assert prefill_ms <= t.prefill_ms
    assert timings
    missed = [t for t in timings if t.total_ms - phase_sum(t) > tol * t.total_ms]
    assert len(missed) <= 1 + len(timings) // 10, missed
    uncovered = sum(t.total_ms - phase_sum(t) for t in timings)
    assert uncovered <= tol * sum(t.total_ms for t in timings), uncovered
    return timings


def test_step_timing_phases_sum_to_the_step(recorded: Recorded) -> None:
    timings = check_step_timing(recorded.run.steps)
    st = recorded.stats
    assert len(timings) == st.steps["spec"] + st.steps["plain"]
    assert sum(t.mode == "spec" for t in timings) == st.steps["spec"]


def slowed(fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


class SlowPolicy:
    """A policy that takes ``seconds`` to decide (public seam: SpecConfig.policy)."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def decide(self, ctx: Any) -> Any:
        time.sleep(self.seconds)
        return self.inner.decide(ctx)

    def observe(self, decision: Any, measured_ms: float, accepted: list[int]) -> None:
        self.inner.observe(decision, measured_ms, accepted)


@pytest.mark.parametrize("policy", ["always", "never"])
def test_phases_cover_the_whole_step(micro_target: Path, trained_head: Path,  # noqa: F811
                                     policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow down the work between the timed phases (policy decision, making KV room, emitting
    tokens, draft extend): every slowed call must land in some phase, and the draft's extend
    over the prompt in Prefill.seconds."""
    engine = make_engine(micro_target, trained_head, TRACE_CONFIG)
    nap = 0.02
    # public seams: a slow policy, a hook inside each draft extend, the output processor
    engine.hooks.register(lambda e: time.sleep(nap), [DraftExtended])
    monkeypatch.setattr(engine.out, "append_tokens", slowed(engine.out.append_tokens, nap))
    sched = engine.scheduler
    assert sched is not None
    monkeypatch.setattr(sched, "ensure_decode_room", slowed(sched.ensure_decode_room, nap))
    inner = wb.Never() if policy == "never" else wb.Always()
    spec = wb.SpecConfig(**SPEC, policy=SlowPolicy(inner, nap))  # type: ignore[arg-type]
    sp = wb.SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.set_spec(spec)
    with wb.trace(engine) as rec:
        rids = [engine.add_request(p, sp) for p in arrival_prompts()[:2]]
        steps = []
        while engine.has_unfinished():
            n0 = len(rec.events)
            outs = engine.step()
            steps.append(StepSlice(rec.events[n0:], {o.rid: o.new_token_ids for o in outs},
                                   {o.rid for o in outs if o.finished}))
    timings = check_step_timing(steps)
    want = "plain" if policy == "never" else "spec"
    # (always: a step where every request decodes its last token runs plainly)
    decode_steps = [s for s in steps if of(s.events, StepTiming)]
    assert timings and all(t.mode == want or set(s.deltas) <= s.finished
                           for t, s in zip(timings, decode_steps, strict=True))
    assert all(t.total_ms >= 1e3 * 2 * nap for t in timings)
    (pf,) = of(rec.events, Prefill)
    assert sorted(pf.rids) == sorted(rids) and pf.seconds >= nap + nap * len(rids), \
        "Prefill.seconds covers the draft's extend and the first tokens' emission"
    engine.close()


# ---- frames and files ---------------------------------------------------------------------


def test_frames_agree_with_engine_stats(recorded: Recorded) -> None:
    rec, st, run = recorded.rec, recorded.stats, recorded.run
    n_nodes, n_steps = SPEC["num_draft_tokens"], SPEC["num_steps"]
    verify = rec.frame("verify")
    assert len(verify) == st.verify_ct == st.num_drafts
    assert verify["accept_length"].tolist() == st.accept_lengths
    assert int(verify["n_drafted"].sum()) == st.num_draft_tokens == st.verify_ct * (n_nodes - 1)
    assert int((verify["accept_length"] - 1).sum()) == st.num_accepted_tokens

    tree = rec.frame("tree")
    assert len(tree) == st.verify_ct * n_nodes and tree["verified"].all()
    assert int((tree["accepted"] & (tree["node"] > 0)).sum()) == st.num_accepted_tokens
    assert (tree.loc[tree["accepted"], "target_token"] >= 0).all()

    by_depth = rec.frame("accept_by_depth")
    depths = by_depth["depth"].tolist()
    assert depths == list(range(1, len(depths) + 1)) and len(depths) <= n_steps
    assert int(by_depth["accepted"].sum()) == st.num_accepted_tokens
    assert int(by_depth["drafted"].sum()) == st.num_draft_tokens
    per_pos = st.accepted_per_pos + [0] * (len(depths) - len(st.accepted_per_pos))
    assert by_depth["accepted"].tolist() == per_pos  # accepted at depth d = at position d-1
    assert by_depth["trees"].iloc[0] == st.verify_ct and (by_depth["trees"] <= st.verify_ct).all()
    assert math.isclose(by_depth["accepted"].sum() / by_depth["drafted"].sum(), st.accept_rate)

    timing = rec.frame("timing")
    assert len(timing) == st.steps["spec"] + st.steps["plain"] == len(rec.frame("policy"))
    assert (timing["mode"] == "spec").sum() == st.steps["spec"]
    assert len(rec.frame("draft")) == sum(
        len(toks) for e in of(rec.events, DraftStep) for toks in e.tokens)
    assert len(of(rec.events, DraftStep)) == n_steps * st.steps["spec"]

    kv = rec.frame("kv")
    assert len(kv) == len(timing)
    page = recorded.engine.kv_usage()["page_size"]
    assert (kv["used_tokens"] <= kv["used_blocks"] * page).all() and (kv["used_tokens"] > 0).any()
    assert kv["used_blocks"].iloc[-1] == 0 == recorded.engine.kv_usage()["used_blocks"]

    reqs = rec.frame("requests").set_index("rid").loc[run.rids]
    assert reqs["output_len"].tolist() == [len(o.token_ids) for o in run.outputs]
    assert int(reqs["output_len"].sum()) == st.generated_tokens
    assert reqs["verify_ct"].sum() == st.verify_ct
    for out, tau in zip(run.outputs, reqs["tau"], strict=True):
        assert (math.isnan(tau) and not out.metrics.accept_lengths) or math.isclose(
            tau, out.metrics.accept_length)
    if recorded.stats.num_accepted_tokens == 0:
        assert recorded.policy == "always"  # the random head: acceptance may be zero
    admitted = rec.frame("admitted")
    assert sorted(admitted["rid"]) == sorted(run.rids)


def test_jsonl_round_trip_is_lossless(recorded: Recorded, tmp_path: Path) -> None:
    evs = recorded.rec.events
    path = write_jsonl(evs, tmp_path / "run.jsonl")
    back = read_jsonl(path)
    assert back == evs
    assert [type(e) for e in back] == [type(e) for e in evs]
    assert [e.t for e in back] == [e.t for e in evs]
    assert recorded.rec.to_jsonl(tmp_path / "again.jsonl").read_text() == path.read_text()
    again = RecordingTracer()
    for e in back:
        again.emit(e)
    for kind in ("verify", "tree", "accept_by_depth", "timing", "requests", "kv", "draft"):
        pd.testing.assert_frame_equal(again.frame(kind), recorded.rec.frame(kind))


# ---- hooks on a live engine ------------------------------------------------------------------


def test_raising_hook_is_isolated_and_the_engine_keeps_serving(
        micro_target: Path, trained_head: Path, reference: list[list[int]]) -> None:  # noqa: F811
    engine = make_engine(micro_target, trained_head, TRACE_CONFIG)
    calls: list[Verified] = []
    seen: list[Verified] = []

    def bad(e: Event) -> None:
        calls.append(e)  # type: ignore[arg-type]
        raise ValueError("boom")

    handle = engine.hooks.register(bad, event_types=(Verified,))
    engine.hooks.register(seen.append, event_types=(Verified,))
    with warnings.catch_warnings(record=True) as caught, wb.trace(engine) as rec:
        warnings.simplefilter("always")
        run = drive(engine, make_spec("always"), rec)
    assert run.tokens == reference
    hook_warnings = [w for w in caught if issubclass(w.category, HookError)]
    assert len(hook_warnings) == 1 and "boom" in str(hook_warnings[0].message)
    assert len(calls) == 1 and handle not in engine.hooks and len(engine.hooks) == 1
    ((name, etype, err),) = engine.hooks.errors
    assert name.endswith("bad") and etype == "Verified" and err == "ValueError('boom')"
    # the other hook and the recorder saw every Verified, the failing one's included
    assert seen == of(rec.events, Verified) and calls[0] in seen
    assert len(seen) == engine.stats.verify_ct
    assert engine.kv_usage()["used_blocks"] == 0
    engine.close()


# A workload where accepted paths often skip tree nodes (their KV rows move at commit).
FATAL_SEED, FATAL_BATCH, FATAL_NEW = 2, 6, 40


@pytest.mark.parametrize("then", ["continue", "abort"])
def test_fatal_hook_stops_the_step_and_the_engine_stays_consistent(
        micro_target: Path, trained_head: Path, then: str) -> None:  # noqa: F811
    """A fatal hook's HookFailed propagates out of ``step``, cutting the step short, and the
    engine stays consistent: a request the step fault did not fail goes on to its greedy
    output (one it failed holds a prefix of it), aborting what is left frees all KV, and the
    engine serves new requests."""
    engine = make_engine(micro_target, trained_head, TRACE_CONFIG)
    rng = random.Random(FATAL_SEED)
    ps = [[rng.randrange(1, 299) for _ in range(rng.randrange(4, 30))]
          for _ in range(FATAL_BATCH)]
    sp = wb.SamplingParams(max_new_tokens=FATAL_NEW, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(ps, sp)]  # plain greedy
    prev: list[Verified] = []

    def strict(e: Event) -> None:
        # Fail on a request whose step-mate, verified just before it, had its accepted path's
        # KV rows moved: if that step-mate were advanced but its KV not compacted, it would
        # continue from a corrupted cache.
        assert isinstance(e, Verified)
        p = prev[-1] if prev else None
        if p is not None and p.step == e.step and p.accepted_path != list(
                range(len(p.accepted_path))):
            raise ValueError("stop here")
        prev.append(e)

    handle = engine.hooks.register(strict, event_types=(Verified,), fatal=True)
    engine.set_spec(make_spec("always"))
    rids = [engine.add_request(p, sp) for p in ps]
    with pytest.raises(HookFailed) as info:
        while engine.has_unfinished():
            engine.step()
    err = info.value
    assert isinstance(err.__cause__, ValueError) and err.event_type == "Verified"
    assert handle not in engine.hooks and len(engine.hooks.errors) == 1
    if then == "continue":
        while engine.has_unfinished():
            engine.step()
        for r, w in zip(rids, want, strict=True):
            out = engine.output(r)
            if out.finish_reason == "error":  # failed by the step fault, KV freed
                assert "HookFailed" in (out.error or "")
                assert out.token_ids == w[: len(out.token_ids)]
            else:
                assert out.token_ids == w, r
    else:
        for r in rids:
            engine.abort(r)
        assert not engine.has_unfinished()
        assert engine.num_running() == engine.num_waiting() == 0
        assert {engine.output(r).finish_reason for r in rids} <= {"abort", "length", "error"}
    engine.set_spec(None)
    assert engine.kv_usage()["used_blocks"] == 0
    outs = engine.generate(ps[:2], sp, spec=make_spec("always"))
    assert [o.token_ids for o in outs] == want[:2]
    assert engine.kv_usage()["used_blocks"] == 0
    engine.close()


# ---- the overhead benchmark ---------------------------------------------------------------


def test_trace_overhead_bench_runs_and_restores_the_engine(micro_target: Path,
                                                            trained_head: Path) -> None:  # noqa: F811
    from workbench.bench.trace_overhead import MODES, format_table, run_trace_overhead

    engine = make_engine(micro_target, trained_head, TRACE_CONFIG)
    dispatcher = engine.trace
    df = run_trace_overhead(engine, arrival_prompts()[:2], batch_sizes=(1, 3), max_new_tokens=3,
                            repeats=1, warmup=False)
    assert engine.trace is dispatcher and engine.tracer.enabled is False and not engine.hooks
    assert len(df) == 2 * 2 * len(MODES)  # (baseline, tree) x (bs 1, 3) x modes
    assert df["same_tokens"].all() and (df["tokens"] > 0).all()
    assert (df.loc[df["mode"] == "no_hooks", "overhead_pct"] == 0.0).all()
    assert (df.loc[df["mode"] == "default", "guard_est_pct"] >= 0.0).all()
    assert "no_hooks" in format_table(df)
    with pytest.raises(ValueError, match="no tracer"), wb.trace(engine):
        run_trace_overhead(engine, arrival_prompts()[:1], batch_sizes=(1,), repeats=1)
    engine.close()


def test_events_nobody_records_are_never_built(micro_target: Path, trained_head: Path,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracer keeping only StepTiming pays for no DraftStep / TreeBuilt / Verified (their
    tensor → list conversions are a large share of a step); a hook on one kind builds that kind
    alone; the outputs are the same either way."""
    built: Counter[str] = Counter()
    for cls in (DraftStep, TreeBuilt, Verified, StepTiming, PolicyDecision):
        orig = cls.of

        def counting(*a: Any, _orig: Any = orig, _name: str = cls.__name__, **k: Any) -> Any:
            built[_name] += 1
            return _orig(*a, **k)

        monkeypatch.setattr(cls, "of", counting)
    engine = make_engine(micro_target, trained_head, TRACE_CONFIG)
    try:
        with wb.trace(engine, events=["StepTiming"]) as rec:
            only_timing = drive(engine, make_spec("always"), rec)
        assert built["StepTiming"] > 0 and rec.events
        assert all(isinstance(e, StepTiming) for e in rec.events)
        assert built["DraftStep"] == built["TreeBuilt"] == built["Verified"] == 0
        assert built["PolicyDecision"] == 0
        seen: list[Event] = []
        handle = engine.hooks.register(seen.append, ["Verified"])
        hooked = drive(engine, make_spec("always"))
        engine.hooks.unregister(handle)
        assert built["Verified"] > 0 and seen and all(isinstance(e, Verified) for e in seen)
        assert built["DraftStep"] == built["TreeBuilt"] == 0
        assert only_timing.tokens == hooked.tokens
    finally:
        engine.close()
