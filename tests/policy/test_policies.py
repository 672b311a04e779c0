"""Speculation policies and the cost model, driven by hand: ``decide``/``observe`` with a known
cost model (no engine; the engine side is in tests/engine/test_worker.py and
tests/engine/test_calibrate.py, outputs in tests/speculative/test_policy_lossless.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import workbench as wb
from workbench.policy.costmodel import CostModel, CostSample, LinearCost
from workbench.policy.goodput import PROBE_CONFIRM_MAX, Goodput
from workbench.policy.policies import (
    Always,
    BatchThreshold,
    Decision,
    Never,
    PolicyContext,
    RandomFlip,
    StepTable,
    depth_rates,
)


def ctx(batch: int, step: int = 0, shape: tuple[int, int, int] = (5, 4, 16)) -> PolicyContext:
    return PolicyContext(step, batch, *shape)


# -- BatchThreshold, Always, Never --------------------------------------------------------------
@pytest.mark.parametrize(("n", "batch", "speculate"), [
    (4, 1, True), (4, 4, True), (4, 5, False), (1, 1, True), (1, 2, False), (0, 1, False),
    (0, 64, False),
])
def test_threshold_edges(n: int, batch: int, speculate: bool) -> None:
    d = BatchThreshold(n).decide(ctx(batch))
    assert d.speculate is speculate
    if speculate:
        assert (d.num_steps, d.topk, d.num_draft_tokens) == (5, 4, 16)


def test_threshold_rejects_negative() -> None:
    with pytest.raises(ValueError, match="BatchThreshold.n"):
        BatchThreshold(-1)


def test_always_never() -> None:
    assert Always().decide(ctx(64)).shape == (5, 4, 16)
    assert Never().decide(ctx(1)).speculate is False


# -- StepTable ----------------------------------------------------------------------------------
TIERS = {(1, 4): (5, 4, 16), (5, 16): (3, 1, 4), (17, None): None}


@pytest.mark.parametrize(("batch", "shape"), [
    (1, (5, 4, 16)), (4, (5, 4, 16)), (5, (3, 1, 4)), (16, (3, 1, 4)), (17, None), (10_000, None),
])
def test_step_table_lookup(batch: int, shape: tuple[int, int, int] | None) -> None:
    table = StepTable(TIERS)
    d = table.decide(ctx(batch))
    assert d.shape == shape == table.lookup(batch)
    assert "tier" in d.reason


def test_step_table_accepts_inf_and_unordered_keys() -> None:
    table = StepTable({(9, math.inf): None, (1, 8): (2, 2, 4)})
    assert table.lookup(8) == (2, 2, 4) and table.lookup(9) is None


@pytest.mark.parametrize(("tiers", "match"), [
    ({(1, 4): (5, 4, 16), (6, None): None}, r"gap: decode batch 5\.\.5"),
    ({(2, None): None}, r"gap: decode batch 1\.\.1"),
    ({(1, 4): None, (5, 9): None}, r"gap: decode batch 10\.\.inf"),
    ({(1, 4): None, (4, None): None}, r"overlap: \(1, 4\) and \(4, inf\)"),
    ({(1, None): (5, 1, 16)}, "chain"),
    ({(1, None): (2, 2, 9)}, "num_draft_tokens"),
    ({(0, None): None}, "lo must be"),
    ({(5, 2): None}, "hi must be"),
    ({}, "non-empty"),
])
def test_step_table_validation(tiers: dict, match: str) -> None:
    with pytest.raises(wb.ConfigError, match=match):
        StepTable(tiers)


# -- RandomFlip ---------------------------------------------------------------------------------
def test_random_flip() -> None:
    assert not any(RandomFlip(0.0).decide(ctx(1)).speculate for _ in range(50))
    assert all(RandomFlip(1.0).decide(ctx(1)).speculate for _ in range(50))
    a, b = RandomFlip(0.5, seed=3), RandomFlip(0.5, seed=3)
    seq = [a.decide(ctx(1)).speculate for _ in range(200)]
    assert seq == [b.decide(ctx(1)).speculate for _ in range(200)]
    assert 60 < sum(seq) < 140 and a.flips > 50
    a.reset()
    assert [a.decide(ctx(1)).speculate for _ in range(200)] == seq
    shapes = [(1, 1, 2), (3, 2, 6)]
    f = RandomFlip(1.0, seed=0, shapes=shapes)
    got = {f.decide(ctx(1)).shape for _ in range(50)}
    assert got == set(shapes)
    with pytest.raises(wb.ConfigError, match="RandomFlip.p"):
        RandomFlip(1.5)


# -- cost model -----------------------------------------------------------------------------------
def test_linear_fit_recovers_a_b() -> None:
    rng = np.random.default_rng(0)
    t = np.repeat([1, 2, 4, 8, 16, 32, 64, 128], 3).astype(float)
    ms = 2.0 + 0.03 * t + rng.normal(0, 0.01, t.size)
    fit = LinearCost.fit(t, ms)
    assert fit.a == pytest.approx(2.0, abs=0.02) and fit.b == pytest.approx(0.03, abs=1e-3)
    assert fit.c == 0.0  # one context: no attention term
    ctxs = np.tile([64.0, 512.0], t.size // 2 + 1)[: t.size]
    ms2 = 2.0 + 0.03 * t + 0.02 * t * ctxs / 1e3
    fit2 = LinearCost.fit(t, ms2, ctxs)
    assert (fit2.a, fit2.b, fit2.c) == pytest.approx((2.0, 0.03, 0.02), abs=1e-6)
    one = LinearCost.fit([8, 8], [1.0, 3.0])  # one token count: the mean, no slope
    assert (one.a, one.b) == pytest.approx((2.0, 0.0))


def test_cost_model_fit_and_compose() -> None:
    samples = [CostSample("target", t, 1.0 + 0.05 * t) for t in (1, 4, 16, 64)]
    samples += [CostSample("draft", t, 0.3 + 0.01 * t) for t in (1, 4, 16, 64)]
    samples += [CostSample("spec_overhead", b, 0.5 + 0.1 * b) for b in (1, 4, 16)]
    cm = CostModel.fit(samples)
    assert cm.target.a == pytest.approx(1.0) and cm.draft.b == pytest.approx(0.01)
    assert cm.plain_overhead == LinearCost()
    b, s, k, n, tau = 4, 5, 4, 16, 2.0
    want = (1.0 + 0.05 * b * n) + (s - 1) * (0.3 + 0.01 * b * k) + (0.3 + 0.01 * b * tau) \
        + (0.5 + 0.1 * b)
    assert cm.spec_step_ms(b, s, k, n, tau) == pytest.approx(want)
    assert cm.plain_step_ms(b, warm=True) == pytest.approx(1.2 + 0.34)
    assert cm.plain_step_ms(b, warm=False) == pytest.approx(1.2)
    assert CostModel.from_dict(json.loads(json.dumps(cm.to_dict()))) == cm
    with pytest.raises(wb.ConfigError, match="target"):
        CostModel.fit([CostSample("draft", 1, 1.0)])
    with pytest.raises(wb.ConfigError, match="kind"):
        CostSample("verify", 1, 1.0)


def test_cost_model_online_ema() -> None:
    cm = CostModel(target=LinearCost(a=1.0), ema=0.5)
    cm.observe("target", 10, 2.0)  # measured twice the prediction
    assert cm.scale["target"] == pytest.approx(1.5)
    assert cm.target_ms(10) == pytest.approx(1.5)
    for _ in range(30):
        cm.observe_step("spec", 4.0, 2.0)
    assert cm.scale["spec"] == pytest.approx(0.5, rel=1e-3)
    before = cm.scale["plain"]
    cm.observe_step("plain", 1.0, 1000.0)  # a step that also ran a long prefill: clipped
    assert cm.scale["plain"] <= before * (1 - cm.ema + cm.ema * 4.0) + 1e-9
    with pytest.raises(wb.ConfigError):
        cm.observe_step("verify", 1.0, 1.0)


# -- Goodput (synthetic) -------------------------------------------------------------------------
def synthetic_cost() -> CostModel:
    """Plain ≈ 1.4 ms at B=1; a S5 K4 N16 step ≈ 3.5 ms (≈2.5×): speculation pays iff τ ≳ 2.5."""
    return CostModel(target=LinearCost(a=1.0, b=0.05), draft=LinearCost(a=0.3, b=0.01))


def drive(policy: Goodput, steps: int, batch: int, accept: int | list[int],
          factor: float | Callable[[int], float] = 1.0) -> list[Decision]:
    """Run decide/observe with measured = unscaled prediction × factor(step)."""
    out = []
    for i in range(steps):
        d = policy.decide(ctx(batch, step=i))
        kind = "spec" if d.speculate else "plain"
        f = factor(i) if callable(factor) else factor
        measured = d.predicted_ms / policy.cost_model.scale[kind] * f
        acc = ([min(accept, d.num_steps)] * batch if isinstance(accept, int) else accept) \
            if d.speculate else []
        policy.observe(d, measured, acc)
        out.append(d)
    return out


def test_goodput_acceptance_update_and_tau() -> None:
    g = Goodput(synthetic_cost(), ema=1.0)
    g.update_acceptance(3, 1, [0, 1, 3])
    assert g.acceptance(1, 3) == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert g.expected_tau((3, 1, 4)) == pytest.approx(1 + 2 / 3 + 1 / 3 + 1 / 3)
    assert g.expected_tau((3, 1, 2)) == pytest.approx(1 + 2 / 3)  # N−1 caps the depth
    assert g.acceptance(4, 2) == [0.7, 0.7]  # other widths keep the prior


def test_goodput_speculates_when_acceptance_high() -> None:
    g = Goodput(synthetic_cost(), candidates=[(5, 4, 16)])
    assert g.rates(ctx(2))[None][0] > g.rates(ctx(2))[(5, 4, 16)][0]  # the prior alone: off
    ds = drive(g, 100, batch=2, accept=5)
    assert ds[0].speculate and ds[0].reason.startswith("probe")  # starts off: probe at once
    assert all(d.speculate for d in ds[g.min_dwell + 1:])
    assert g.expected_tau((5, 4, 16)) > 5.5


def test_goodput_turns_off_when_acceptance_zero() -> None:
    g = Goodput(synthetic_cost(), candidates=[(5, 4, 16), (3, 1, 4)], probe_every=0)
    ds = drive(g, 80, batch=2, accept=0)
    assert ds[0].speculate  # optimistic prior: explore first
    first_off = next(i for i, d in enumerate(ds) if not d.speculate)
    assert first_off < 40
    assert not any(d.speculate for d in ds[first_off:])


def test_goodput_turns_off_at_large_batch() -> None:
    """Same acceptance, bigger batch: verifying B·N tokens costs more than the τ it buys."""
    on = drive(Goodput(synthetic_cost()), 10, batch=1, accept=2)
    off = drive(Goodput(synthetic_cost()), 10, batch=64, accept=2)
    assert all(d.speculate for d in on)
    assert off[0].reason.startswith("probe") and not any(d.speculate for d in off[1:])


def tied_policy(**kw: Any) -> Goodput:
    """Off and a S1 chain predicted exactly equal (1 tok/ms) while a_1 stays at 0.7."""
    cm = CostModel(target=LinearCost(a=1.0), spec_overhead=LinearCost(a=0.7))
    return Goodput(cm, candidates=[(1, 1, 2)], probe_every=0, **kw)


def switches(ds: list[Decision]) -> list[int]:
    return [i for i in range(1, len(ds)) if ds[i].speculate != ds[i - 1].speculate]


def test_goodput_hysteresis_no_thrash() -> None:
    batch_accept = [1] * 7 + [0] * 3  # batch rate 0.7 = the estimate: only timing noise moves
    def noise(i: int) -> float:  # alternating slow/fast steps
        return 1.25 if i % 2 else 0.75

    thrash = drive(tied_policy(min_dwell=0, hysteresis=0.0), 200, 10, batch_accept, noise)
    assert len(switches(thrash)) > 20  # the control: no hysteresis, no dwell
    dwell = drive(tied_policy(min_dwell=4, hysteresis=0.0), 200, 10, batch_accept, noise)
    sw = switches(dwell)
    assert all(b - a >= 4 for a, b in zip(sw, sw[1:], strict=False))
    calm = drive(tied_policy(), 200, 10, batch_accept, noise)  # defaults: 4 steps, 5 %
    assert len(switches(calm)) <= 1


def test_goodput_probes_while_off_and_recovers() -> None:
    g = Goodput(synthetic_cost(), candidates=[(5, 4, 16)], probe_every=8)
    ds = drive(g, 140, batch=1, accept=0)
    assert not ds[0].reason.startswith("probe")  # at B=1 the prior says: speculate
    off_from = next(i for i, d in enumerate(ds) if not d.speculate)
    tail = ds[off_from:]
    probes = [i for i, d in enumerate(tail) if d.speculate]
    assert probes and all(tail[i].reason.startswith("probe") for i in probes)
    # probes that find nothing back off: 8 off then a probe, then 16, 32, ... off steps
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:3] == [16, 32, 64], gaps
    assert g.probes == len(probes)
    back = drive(g, 1200, batch=1, accept=5)  # acceptance recovered: (backed-off) probes see it
    assert back[-1].speculate and all(d.speculate for d in back[-20:])
    assert not back[-1].reason.startswith("probe")


def at_batch4_cost() -> CostModel:
    """At decode batch 4 a S5 K4 N16 step costs ≈ 2.3 plain steps: it pays iff τ ≳ 2.3 — above
    τ 1.5 (prior 0.3), below τ 6 (everything accepted) and above τ 1 (nothing accepted)."""
    return CostModel(target=LinearCost(a=1.0, b=0.02), draft=LinearCost(a=0.1, b=0.005))


def test_goodput_pessimistic_start_corrects_itself() -> None:
    """A prior that says "off" at B=4 while every draft is accepted: the first probe's own
    acceptance says speculation pays, so probes follow at once (not after 64 off steps) until
    the estimates agree; on within PROBE_CONFIRM_MAX + min_dwell steps, and stays on."""
    g = Goodput(at_batch4_cost(), candidates=[(5, 4, 16)], prior_accept=0.3)
    rates = g.rates(ctx(4))
    assert rates[None][0] > rates[(5, 4, 16)][0]  # the prior alone: off
    ds = drive(g, 40, batch=4, accept=5)
    assert ds[0].reason.startswith("probe after")
    assert ds[1].reason == "probe: the last probe's acceptance says it pays"
    on = next(i for i, d in enumerate(ds) if d.speculate and not d.reason.startswith("probe"))
    assert on <= PROBE_CONFIRM_MAX + g.min_dwell
    assert all(d.speculate for d in ds[on:])
    assert g.current == (5, 4, 16) and g.expected_tau((5, 4, 16)) > 4.0


def test_goodput_pessimistic_start_stays_off_when_it_does_not_pay() -> None:
    """Same start, nothing accepted: one probe, no follow-up, then backed-off probes only."""
    g = Goodput(at_batch4_cost(), candidates=[(5, 4, 16)], prior_accept=0.3, probe_every=8)
    ds = drive(g, 60, batch=4, accept=0)
    probes = [i for i, d in enumerate(ds) if d.speculate]
    # the start probe found nothing: 16 off steps, then a probe, then 32: no follow-up, never on
    assert probes == [0, 17, 50]
    assert all(ds[i].reason.startswith("probe after") for i in probes)
    assert g.current is None and g.confirm_run == 0


def test_goodput_follow_up_probes_are_bounded() -> None:
    """Acceptance that pays only when judged alone, never in the averaged estimate, cannot keep
    the policy probing: at most PROBE_CONFIRM_MAX follow-ups, then the gap backs off."""
    cm = at_batch4_cost()
    g = Goodput(cm, candidates=[(5, 4, 16)], prior_accept=0.0, probe_every=8, ema=0.01,
                seed_weight=1000, accept_seed={4: [0.0] * 5})
    ds = drive(g, 40, batch=4, accept=5)
    follow = [d for d in ds if d.reason == "probe: the last probe's acceptance says it pays"]
    assert len(follow) == PROBE_CONFIRM_MAX
    assert not any(d.speculate for d in ds[PROBE_CONFIRM_MAX + 1:PROBE_CONFIRM_MAX + 10])


def test_goodput_starts_from_measured_acceptance() -> None:
    """accept_seed (measured on the workload) replaces the prior: on from the first step at B=4
    with no probe, and the seed counts as seed_weight observations (a contrary step moves it
    by 1/(seed_weight + 1), not by half)."""
    g = Goodput(at_batch4_cost(), candidates=[(5, 4, 16), (3, 1, 4)], prior_accept=0.3,
                accept_seed={4: [0.9, 0.9, 0.85, 0.8, 0.8]})
    assert g.acceptance(4, 5) == [0.9, 0.9, 0.85, 0.8, 0.8]
    assert g.acceptance(1, 3) == [0.3, 0.3, 0.3]  # chains: not measured, the prior
    d = g.decide(ctx(4))
    assert d.speculate and d.shape == (5, 4, 16) and not d.reason.startswith("probe")
    g.observe(d, d.predicted_ms, [0, 0, 0, 0])
    assert g.acceptance(4, 1)[0] == pytest.approx(0.9 * 4 / 5)
    g.reset()  # forgets what it observed, keeps the seed
    assert g.acceptance(4, 2) == [0.9, 0.9]


def test_goodput_explores_a_stale_candidate_while_on() -> None:
    """On a chain because the tree's estimate is stale-low (seeded 0.6) while the tree really
    accepts everything: every probe_every steps on, one step explores the best other shape;
    its own acceptance says it pays, so explores follow until the estimates agree and the
    policy moves to the tree. The chain explored from the tree does not pay: no follow-up."""
    g = Goodput(synthetic_cost(), candidates=[(5, 1, 6), (5, 4, 16)], probe_every=16,
                accept_seed={4: [0.6] * 5}, seed_weight=1)
    ds = []
    for i in range(60):
        d = g.decide(ctx(1, step=i))
        g.observe(d, d.predicted_ms / g.cost_model.scale["spec"],
                  [3 if d.topk == 1 else 5] if d.speculate else [])
        ds.append(d)
    assert all(d.shape == (5, 1, 6) for d in ds[:16])  # the stale estimate: chain first
    assert ds[16].shape == (5, 4, 16) and ds[16].reason == "explore after 16 S5K1N6 steps"
    assert ds[17].reason == "explore: the last explore's acceptance says it pays"
    on = next(i for i, d in enumerate(ds) if d.reason.startswith("goodput S5K4N16"))
    assert on <= 16 + PROBE_CONFIRM_MAX + 1
    tail = ds[on:]
    assert [d.reason for d in tail if d.shape != (5, 4, 16)] == [
        "explore after 16 S5K4N16 steps"]  # one explore back, then the gap doubles
    assert g.current == (5, 4, 16)


def test_depth_rates() -> None:
    assert depth_rates([0, 2, 5, 5], 5) == [0.75, 1.0, 2 / 3, 1.0, 1.0]
    assert depth_rates([0, 0], 3) == [0.0]  # depth 2 reached by nobody: stop
    assert depth_rates([], 3) == []


def test_goodput_validation() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"ema": 0.0}, "ema"), ({"min_dwell": -1}, "min_dwell"), ({"candidates": []}, "candidates"),
        ({"candidates": [(3, 1, 5)]}, "chain"), ({"probe_every": -2}, "probe_every"),
        ({"prior_accept": 2.0}, "prior"), ({"seed_weight": 0}, "seed_weight"),
        ({"accept_seed": {0: [0.5]}}, "accept_seed"),
        ({"accept_seed": {4: [1.5]}}, r"accept_seed\[4\]")]
    for kw, match in cases:
        with pytest.raises(wb.ConfigError, match=match):
            Goodput(synthetic_cost(), **kw)
