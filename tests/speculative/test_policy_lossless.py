"""Policies never change greedy outputs: on/off every step (warm and cold draft), varying tree
shapes, Goodput and StepTable — batched with staggered arrivals and aborts — equal baseline.

Heads: a random head (acceptance ≈ 0) and a head trained for a few seconds (τ ≈ 1.9), so
switches happen both after rejected and after accepted draft tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from helpers import id_prompts, make_engine

import workbench as wb
from workbench.policy.costmodel import CostModel, LinearCost
from workbench.policy.goodput import Goodput
from workbench.policy.policies import RandomFlip, StepTable
from workbench.trace import DraftExtended

State = Literal["warm", "cold", "auto"]
SHAPE: dict[str, Any] = {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
SP = wb.SamplingParams(max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=["trained_head", "random_head"])
def engine(request: pytest.FixtureRequest, micro_target: Path) -> Iterator[wb.Engine]:
    head = request.getfixturevalue(request.param)
    e = make_engine(micro_target, head, kv_budget_tokens=8192)
    e.head_name = request.param  # type: ignore[attr-defined]
    yield e
    e.close()


def run(engine: wb.Engine, ps: list[list[int]], spec: wb.SpecConfig | None, batch: int,
        aborts: dict[int, int] | None = None) -> list[list[int]]:
    """At most ``batch`` in flight, arrivals staggered by a step; ``aborts`` maps prompt index →
    steps after admission at which it is aborted (its partial output is returned)."""
    aborts = aborts or {}
    engine.set_spec(spec)
    try:
        queue = list(enumerate(ps))
        live: dict[int, tuple[int, int]] = {}  # rid → (prompt index, steps so far)
        out: dict[int, list[int]] = {}
        while queue or live:
            while queue and len(live) < batch:
                i, p = queue.pop(0)
                live[engine.add_request(p, SP)] = (i, 0)
                if len(live) < batch:
                    break  # stagger: the next one arrives a step later
            for o in engine.step():
                if o.finished and o.rid in live:
                    out[live.pop(o.rid)[0]] = engine.output(o.rid).token_ids
            for rid, (i, n) in list(live.items()):
                if aborts.get(i) == n + 1:
                    engine.abort(rid)
                    out[live.pop(rid)[0]] = engine.output(rid).token_ids
                else:
                    live[rid] = (i, n + 1)
        assert engine.kv_usage()["used_blocks"] == 0
        return [out[i] for i in range(len(ps))]
    finally:
        engine.set_spec(None)


_BASE: dict[tuple[str, int, int, int], list[list[int]]] = {}


def baseline(engine: wb.Engine, n: int, seed: int, batch: int) -> list[list[int]]:
    key = (engine.head_name, n, seed, batch)  # type: ignore[attr-defined]
    if key not in _BASE:
        _BASE[key] = run(engine, id_prompts(n, seed, lo=2, hi=30), None, batch)
    return _BASE[key]


def spec_steps(engine: wb.Engine) -> tuple[int, int]:
    return engine.stats.steps["spec"], engine.stats.steps["plain"]


@pytest.mark.parametrize("state", ["warm", "cold", "auto"])
@pytest.mark.parametrize("batch", [4, 13])
def test_random_flip_equals_baseline(engine: wb.Engine, state: State, batch: int) -> None:
    base = baseline(engine, 13, 1, batch)
    s0, p0 = spec_steps(engine)
    spec = wb.SpecConfig(**SHAPE, draft_state=state, policy=RandomFlip(0.5, seed=batch))
    assert run(engine, id_prompts(13, 1, lo=2, hi=30), spec, batch) == base
    s1, p1 = spec_steps(engine)
    assert s1 > s0 and p1 > p0  # both kinds of step (and switches) happened


@pytest.mark.parametrize("state", ["warm", "cold", "auto"])
def test_random_shapes_equal_baseline(engine: wb.Engine, state: State) -> None:
    """Each speculative step draws its own (S, K, N): chains, trees, depth 1 to 5."""
    shapes = [(1, 1, 2), (3, 2, 6), (5, 4, 16), (4, 1, 5), (2, 3, 7)]
    spec = wb.SpecConfig(**SHAPE, draft_state=state,
                         policy=RandomFlip(0.7, seed=7, shapes=shapes))
    assert run(engine, id_prompts(13, 1, lo=2, hi=30), spec, 13) == baseline(engine, 13, 1, 13)


@pytest.mark.parametrize("state", ["warm", "cold", "auto"])
def test_aborts_leave_baseline_prefixes(engine: wb.Engine, state: State) -> None:
    base = baseline(engine, 13, 1, 4)
    aborts = {0: 3, 2: 1, 5: 6, 9: 4, 12: 2}  # prompt index → steps after admission
    spec = wb.SpecConfig(**SHAPE, draft_state=state, policy=RandomFlip(0.5, seed=11))
    got = run(engine, id_prompts(13, 1, lo=2, hi=30), spec, 4, aborts)
    for i, (g, b) in enumerate(zip(got, base, strict=True)):
        if i in aborts:
            assert b[: len(g)] == g and len(g) < len(b)
        else:
            assert g == b


@pytest.mark.parametrize("state", ["warm", "cold", "auto"])
def test_goodput_equals_baseline(engine: wb.Engine, state: State) -> None:
    """Goodput over two shapes with a cost model that makes on/off a close call: it switches."""
    cm = CostModel(target=LinearCost(a=1.0, b=0.05), draft=LinearCost(a=0.3, b=0.01))
    policy = Goodput(cm, candidates=[(3, 2, 6), (4, 1, 5)], min_dwell=2, probe_every=4)
    spec = wb.SpecConfig(**SHAPE, draft_state=state, policy=policy)
    s0, p0 = spec_steps(engine)
    assert run(engine, id_prompts(13, 1, lo=2, hi=30), spec, 13) == baseline(engine, 13, 1, 13)
    s1, p1 = spec_steps(engine)
    assert s1 > s0 and p1 > p0 and policy.switches >= 1


@pytest.mark.parametrize("state", ["warm", "cold", "auto"])
def test_step_table_equals_baseline(engine: wb.Engine, state: State) -> None:
    """Tiers change as the staggered batch grows and drains: tree, chain, off."""
    table = StepTable({(1, 3): (5, 4, 16), (4, 8): (3, 1, 4), (9, None): None})
    spec = wb.SpecConfig(**SHAPE, draft_state=state, policy=table)
    s0, p0 = spec_steps(engine)
    assert run(engine, id_prompts(13, 1, lo=2, hi=30), spec, 13) == baseline(engine, 13, 1, 13)
    s1, p1 = spec_steps(engine)
    assert s1 > s0 and p1 > p0


def test_cold_catch_up_keeps_acceptance(engine: wb.Engine) -> None:
    """A cold draft caught up after off steps accepts like a warm one (same flips, same τ):
    losslessness alone would not notice a stale draft, acceptance does."""
    if engine.head_name != "trained_head":  # type: ignore[attr-defined]
        pytest.skip("needs a head that accepts drafts")
    taus = {}
    for state in ("warm", "cold"):
        before = len(engine.stats.accept_lengths)
        spec = wb.SpecConfig(**SHAPE, draft_state=state, policy=RandomFlip(0.5, seed=3))
        assert run(engine, id_prompts(13, 1, lo=2, hi=30), spec, 13) == baseline(engine, 13, 1, 13)
        acc = engine.stats.accept_lengths[before:]
        taus[state] = sum(acc) / len(acc)
    assert taus["warm"] > 1.3
    assert taus["cold"] == pytest.approx(taus["warm"], abs=0.1)


class OffStretches:
    """Speculate except during long off stretches (steps 4-23 and 40-69 of each run)."""

    def __init__(self) -> None:
        self.step = 0

    def decide(self, ctx: Any) -> Any:
        from workbench.policy.policies import Decision

        self.step += 1
        if 4 <= self.step < 24 or 40 <= self.step < 70:
            return Decision(False, reason="stretch off")
        return Decision(True, num_steps=ctx.num_steps, topk=ctx.topk,
                        num_draft_tokens=ctx.num_draft_tokens, reason="on")

    def observe(self, decision: Any, measured_ms: float, accepted: list[int]) -> None:
        """Nothing to learn."""


def extends(engine: wb.Engine, ps: list[list[int]], spec: wb.SpecConfig | None,
            batch: int) -> tuple[list[list[int]], list[DraftExtended]]:
    """``run`` with a trace: the outputs and the draft extends that ran (DraftExtended)."""
    with wb.trace(engine, events=[DraftExtended]) as tr:
        out = run(engine, ps, spec, batch)
    return out, tr.of(DraftExtended)  # type: ignore[return-value]


def test_auto_goes_cold_in_long_off_stretches(engine: wb.Engine) -> None:
    """draft_state="auto": the first AUTO_WARM_STEPS plain steps of an off stretch extend the
    draft, later ones do not, and speculation resumes losslessly: fewer extends than warm, more
    than cold, same outputs as the baseline."""
    base = baseline(engine, 13, 1, 4)
    calls: dict[str, int] = {}
    for state in ("warm", "auto", "cold"):
        spec = wb.SpecConfig(**SHAPE, draft_state=state, policy=OffStretches())
        out, evs = extends(engine, id_prompts(13, 1, lo=2, hi=30), spec, 4)
        assert out == base, state
        calls[state] = len(evs)
    assert calls["cold"] < calls["auto"] < calls["warm"], calls


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("batch", [4, 13])
def test_catchup_window_holes_equal_baseline(engine: wb.Engine, window: int,
                                             batch: int) -> None:
    """Cold off stretches longer than ``catchup_window`` leave draft holes (positions the
    draft never sees): speculation after them still equals the baseline, and the catch-up
    extends over at most ``window`` positions per request."""
    base = baseline(engine, 13, 1, batch)
    spec = wb.SpecConfig(**SHAPE, draft_state="cold", catchup_window=window,
                         policy=OffStretches())
    out, evs = extends(engine, id_prompts(13, 1, lo=2, hi=30), spec, batch)
    assert out == base
    holed = [(rows, hs) for e in evs for rows, hs in zip(e.rows, e.holes, strict=True) if hs]
    holes = [[tuple(h) for h in hs] for _, hs in holed]
    # a request with holes was trimmed: its catch-up is at most the window (or, after a
    # verify, the accepted path: at most S+1 = 4 positions)
    widest = [max([0] + [rows for rows, _ in holed])]
    assert holes, "no off stretch outgrew the window"
    assert all(s < e for hs in holes for s, e in hs)
    assert all(hs[i][1] < hs[i + 1][0] for hs in holes for i in range(len(hs) - 1))
    assert 0 < widest[0] <= max(window, SHAPE["num_steps"] + 1)


def test_keep_feats_window_trims_into_holes() -> None:
    """Trimming keeps the newest rows, moves DraftState.len past the dropped ones and merges
    adjacent holes; pending always covers exactly [DraftState.len, kv_len)."""
    import torch

    from workbench.core import DraftState

    r = DraftState()  # the request's kv_len is the local ``kv_len``
    r.len = kv_len = 10
    keep = DraftState.keep_feats
    for n in (1, 2, 1, 3):  # a chunk per step (sizes as prefill/commit would give)
        keep(r, torch.full((n, 4), float(kv_len)), 3)
        kv_len += n
        assert sum(f.shape[0] for f in r.pending_feats) == r.pending_rows == \
            kv_len - r.len <= 3
    assert r.holes == [(10, 14)]
    assert torch.cat(r.pending_feats)[:, 0].tolist() == [14.0, 14.0, 14.0]
    r.consumed(kv_len)  # an extend consumed them
    for _ in range(5):
        keep(r, torch.zeros(1, 4), 2)
        kv_len += 1
    assert r.holes == [(10, 14), (17, 20)]
    keep(r, torch.zeros(4, 4), None)  # no window: keeps all
    kv_len += 4
    assert sum(f.shape[0] for f in r.pending_feats) == 6


def test_no_holes_for_page_table_backends(engine: wb.Engine,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft attention backend that needs whole positions (FlashInfer's page tables) gets no
    holes: the window is ignored and the cold catch-up covers everything missed."""
    monkeypatch.setattr(engine.runner.draft_attn, "arbitrary_slots", False)
    spec = wb.SpecConfig(**SHAPE, draft_state="cold", catchup_window=1, policy=OffStretches())
    out, evs = extends(engine, id_prompts(13, 1, lo=2, hi=30), spec, 4)
    assert out == baseline(engine, 13, 1, 4)
    assert evs and not any(hs for e in evs for hs in e.holes)


def test_auto_defers_prompt_extends(engine: wb.Engine) -> None:
    """draft_state="auto": a new prompt's draft extend waits for the request's first
    speculative step, so with speculation off (Never) no prompt is ever extended, while
    "warm" extends each one at prefill; with Always the deferred extend happens and outputs
    equal the baseline."""
    rng = random.Random(5)
    long_prompts = [[rng.randrange(1, 299) for _ in range(40 + 3 * i)] for i in range(4)]
    rows: dict[str, int] = {}
    for state in ("auto", "warm"):
        engine.worker.plain_streak = 0  # as after a speculative step: auto starts warm
        spec = wb.SpecConfig(**SHAPE, draft_state=state, policy=wb.Never())
        _, evs = extends(engine, long_prompts, spec, 4)
        rows[state] = sum(sum(e.rows) for e in evs)
    assert rows["auto"] == 0 and rows["warm"] >= sum(len(p) for p in long_prompts)
    spec = wb.SpecConfig(**SHAPE, draft_state="auto", policy=wb.Always())
    assert run(engine, long_prompts, spec, 4) == run(engine, long_prompts, None, 4)
