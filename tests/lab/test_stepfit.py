"""The step-time model's fit: anchors from measured advances (what is kept, what is left out,
the prefill line), the measuring loop's accounting on a real engine, and the replay pricing a
step's prefill chunks with the measured line. Behaviour, not this machine's speed."""

from __future__ import annotations

import pytest
from labkit import COST

import workbench as wb
from workbench.config import SpecConfig
from workbench.lab.record import RecordedRun
from workbench.lab.sim import Simulator
from workbench.lab.stepfit import (
    AnchoredCostModel,
    StepSample,
    anchored,
    anchors_from,
    measure_steps,
)
from workbench.policy.costmodel import CostModel, LinearCost
from workbench.policy.policies import Always, Never

CHAIN = (3, 1, 4)


def _plain(b: int) -> float:
    return 2.0 + b


def _spec(b: int) -> float:
    return 10.0 + 3.0 * b


def _prefill(t: int) -> float:
    return 1.0 + 0.01 * t


def _samples() -> list[StepSample]:
    out: list[StepSample] = []
    for c in (1, 4):
        i = 0

        def add(arm: str, batch: int, mode: str, tokens: int, ms: float,
                acc: tuple[int, ...] = (), c: int = c) -> None:
            nonlocal i
            out.append(StepSample(arm, c, i, batch, mode, tokens, 100.0 + c, acc, ms))
            i += 1

        add("never", 0, "prefill", 120, 1e3)  # a loop's first advance: first-use costs
        for _ in range(8):  # warm (auto's first 8 plain steps): left out of the cold anchor
            add("never", c, "plain", 0, 99.0)
        for t in (100, 200, 300):  # prefill only, and mixed with plain rows at batch 1
            add("never", 0, "prefill", t, _prefill(t))
            add("never", 1, "plain", t, _plain(1) + _prefill(t))
        for _ in range(20):
            add("never", c, "plain", 0, _plain(c))
        add("never", c, "plain", 0, 50 * _plain(c))  # a preemption: dropped, counted
        i = 0
        add("S3K1N4", 0, "prefill", 120, 1e3)
        for _ in range(10):
            add("S3K1N4", c, "spec", 0, _spec(c), (2,) * c)
        for t in (150, 250):  # chunks beside a speculative step: their own line
            add("S3K1N4", 1, "spec", t, _spec(1) + 2.0 + 0.02 * t, (2,))
        i = 0
        for _ in range(5):  # the baseline engine's steps never enter the speculative fit
            add("baseline", 0, "prefill", 100, 1e4)
    return out


def test_anchors_from_measured_advances() -> None:
    """The anchors are the means of the steady steps (first advance, never's warm steps and a
    preemption left out), τ counts the bonus, the prefill lines are the excess of
    prefill-carrying steps over their decode part (plain or absent / speculative), and the
    model gives all of it back."""
    a = anchors_from(_samples(), {"S3K1N4": CHAIN})
    assert a["batches"] == [1, 4]
    assert a["plain"] == pytest.approx([_plain(1), _plain(4)])
    assert a["plain_samples"] == [21, 21] and a["dropped"] == 2
    m = a["shapes"]["S3K1N4"]
    assert m["spec"] == pytest.approx([_spec(1), _spec(4)]) and m["tau"] == [3.0, 3.0]
    assert m["context"] == [101.0, 104.0]
    plain, spec = a["prefill"]["plain"], a["prefill"]["spec"]
    assert plain["a"] == pytest.approx(1.0) and plain["b"] == pytest.approx(0.01)
    assert plain["samples"] == 12 and plain["tokens"] == [100.0, 300.0]
    assert spec["a"] == pytest.approx(2.0) and spec["b"] == pytest.approx(0.02)
    assert spec["samples"] == 4
    cm = anchored(COST, a)
    assert cm.prefill_ms(250) == pytest.approx(_prefill(250))
    assert cm.prefill_ms(100, spec=True) == pytest.approx(4.0)
    assert cm.plain_step_ms(2, 102.0, warm=False) == pytest.approx(_plain(2))
    assert cm.spec_step_ms(4, *CHAIN, tau=3.0, context=104.0) == pytest.approx(_spec(4))
    # no steady speculative step at all: no model, a clear error
    with pytest.raises(wb.ConfigError, match="no plain or no speculative step"):
        anchors_from([x for x in _samples() if x.arm != "S3K1N4"], {"S3K1N4": CHAIN})


def test_measure_steps_accounts_every_token(lab_engine: wb.Engine,
                                            lab_prompts: list[str]) -> None:
    """Closed loops at c = 1, 2 on one engine: every prompt token is prefilled in exactly one
    advance, plain arms never speculate, a speculating arm's steps carry an accepted count
    per speculating request, no decode batch exceeds c, and the engine's spec is restored."""
    arms = {"baseline": None,
            "never": SpecConfig(3, 1, 4, policy=Never(), draft_state="auto"),
            "S3K1N4": SpecConfig(3, 1, 4, policy=Always(), draft_state="auto")}
    before = lab_engine.spec
    samples = measure_steps(arms, dict.fromkeys(arms, lab_engine), lab_prompts, (1, 2), 6)
    assert lab_engine.spec is before
    lens = [len(lab_engine.tokenize(p)) for p in lab_prompts]
    for arm in arms:
        for c in (1, 2):
            xs = [x for x in samples if x.arm == arm and x.concurrency == c]
            n = max(2 * c, len(lab_prompts))
            assert sum(x.prefill_tokens for x in xs) == sum(lens[i % len(lens)]
                                                           for i in range(n))
            assert [x.index for x in xs] == list(range(len(xs)))
            assert all(x.batch <= c and x.ms > 0 for x in xs)
            modes = {x.mode for x in xs}
            if arm == "S3K1N4":
                assert "spec" in modes
                # one count per speculating request; a request with one token left rides
                assert all(1 <= len(x.accepted) <= x.batch for x in xs if x.mode == "spec")
            else:
                assert modes <= {"plain", "prefill"}


def test_replay_prices_prefill_with_the_measured_line(recorded: RecordedRun) -> None:
    """With prefill lines the replay prices a step's chunks together on the line of its
    kind (nothing else changes): at c = 1 under Never every prompt is one plain-line step."""
    a = anchors_from(_samples(), {"S3K1N4": CHAIN})
    flat = CostModel(LinearCost(0.0))  # components 0: the anchors alone
    without = anchored(flat, {k: v for k, v in a.items() if k != "prefill"})
    with_line = anchored(flat, a)
    assert isinstance(with_line, AnchoredCostModel)
    r0 = Simulator(recorded, without, CHAIN).run_level(Never(), 1)
    r1 = Simulator(recorded, with_line, CHAIN).run_level(Never(), 1)
    chunks = sum(recorded.prompt_lens[i % len(recorded.prompt_lens)]
                 for i in range(r1.row["requests"]))
    n = r1.row["requests"]  # c = 1: one prompt per step, each in one chunk
    line = a["prefill"]["plain"]
    extra = n * line["a"] + line["b"] * chunks
    assert r1.row["seconds"] - r0.row["seconds"] == pytest.approx(extra / 1e3, rel=1e-9)
    assert r1.steps == r0.steps


def test_prefill_line_never_starts_below_zero() -> None:
    """Excesses whose least-squares line would cost a small chunk less than nothing are fitted
    through 0 instead: every chunk costs a positive time."""
    xs = [x for x in _samples() if not (x.prefill_tokens and x.arm == "never")]
    for i, (t, ms) in enumerate([(100, 0.5), (200, 4.0), (300, 7.5)]):  # line: -3 + 0.035 t
        xs.append(StepSample("never", 1, 100 + i, 0, "prefill", t, 0.0, (), ms))
    line = anchors_from(xs, {"S3K1N4": CHAIN})["prefill"]["plain"]
    assert line["a"] == 0.0
    t = [100, 200, 300]
    assert line["b"] == pytest.approx((100 * 0.5 + 200 * 4.0 + 300 * 7.5) / sum(x * x for x in t))
    assert anchored(COST, anchors_from(xs, {"S3K1N4": CHAIN})).prefill_ms(10) > 0
