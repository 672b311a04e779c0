"""The cost model's crossover, ``BatchThreshold.from_cost_model``, the one step recorder
(``RecordingPolicy``) and the measured acceptance: hand-built cost models give exact thresholds."""

from __future__ import annotations

import pytest

import workbench as wb
from workbench.policy.costmodel import Acceptance, CostModel, LinearCost
from workbench.policy.policies import (
    BatchThreshold,
    Decision,
    PolicyContext,
    RecordingPolicy,
    StepRecord,
    depth_rates,
)


def hand_model() -> CostModel:
    """target 1 + 0.1·T ms, draft 0.25 + 0.01·T ms, no overheads. At decode batch B, chain
    S3 (N=4), τ=3:  plain cold = 1 + 0.1B, plain warm = 1.25 + 0.11B,
    spec = (1 + 0.4B) + 2·(0.25 + 0.01B) + (0.25 + 0.03B) = 1.75 + 0.45B ms.
    Plain tok/s ≥ spec tok/s ⇔ 3·plain_ms ≤ spec_ms:
    cold 3 + 0.3B ≤ 1.75 + 0.45B ⇔ B ≥ 8.33 → crossover 9, n = 8;
    warm 3.75 + 0.33B ≤ 1.75 + 0.45B ⇔ B ≥ 16.67 → crossover 17, n = 16."""
    return CostModel(target=LinearCost(a=1.0, b=0.1), draft=LinearCost(a=0.25, b=0.01))


def test_crossover_exact() -> None:
    cm = hand_model()
    cold = cm.crossover((3, 1, 4), 3.0, warm=False)
    assert (cold.n, cold.batch) == (8, 9)
    assert cold.plain_tok_s == pytest.approx(1e3 * 9 / (1 + 0.9))
    assert cold.spec_tok_s == pytest.approx(1e3 * 3 * 9 / (1.75 + 0.45 * 9))
    warm = cm.crossover((3, 1, 4), 3.0, warm=True)
    assert (warm.n, warm.batch) == (16, 17)
    # τ = 1: a speculative step emits what a plain one does at a higher cost: never speculate
    assert (cm.crossover((3, 1, 4), 1.0).n, cm.crossover((3, 1, 4), 1.0).batch) == (0, 1)
    # τ = 4: cold 4 + 0.4B ≤ 1.75 + 0.46B ⇔ B ≥ 37.5; capped at max_batch 16: wins everywhere
    capped = cm.crossover((3, 1, 4), 4.0, max_batch=16)
    assert (capped.n, capped.batch) == (16, None)
    assert cm.crossover((3, 1, 4), 4.0).n == 37
    assert "up to decode batch 8; at 9 plain" in cold.reason()
    assert "every decode batch up to 16" in capped.reason()
    never = cm.crossover((3, 1, 4), 1.0).reason()
    assert "predicted slower than plain (cold draft) at every decode batch: at 1 plain" in never
    assert "up to decode batch 0" not in never
    d = cold.to_dict()
    assert d["n"] == 8 and d["shape"] == [3, 1, 4] and d["reason"] == cold.reason()


def test_tok_s_matches_the_step_predictions() -> None:
    cm = hand_model()
    assert cm.tok_s(4, None, warm=False) == pytest.approx((1e3 * 4 / 1.4, 1.4))
    assert cm.tok_s(4, (3, 1, 4), 2.0) == pytest.approx(
        (1e3 * 2 * 4 / cm.spec_step_ms(4, 3, 1, 4, 2.0), cm.spec_step_ms(4, 3, 1, 4, 2.0)))


@pytest.mark.parametrize(("tau", "max_batch", "match"), [
    (0.5, 64, "tau"), (float("nan"), 64, "tau"), (2.0, 0, "max_batch")])
def test_crossover_errors_name_the_field(tau: float, max_batch: int, match: str) -> None:
    with pytest.raises(wb.ConfigError, match=match):
        hand_model().crossover((3, 1, 4), tau, max_batch=max_batch)


def test_batch_threshold_from_cost_model() -> None:
    cm = hand_model()
    auto = BatchThreshold.from_cost_model(cm, (3, 1, 4), 3.0)  # draft_state auto: cold plain
    assert auto == BatchThreshold(8) and repr(auto) == "BatchThreshold(n=8)"
    assert auto.basis is not None and auto.basis.batch == 9 and not auto.basis.warm
    assert BatchThreshold.from_cost_model(cm, (3, 1, 4), 3.0, draft_state="warm").n == 16
    assert BatchThreshold.from_cost_model(cm, (3, 1, 4), 3.0, draft_state="cold").n == 8
    assert BatchThreshold(8).basis is None  # an int threshold is what it always was
    with pytest.raises(wb.ConfigError, match="draft_state"):
        BatchThreshold.from_cost_model(cm, (3, 1, 4), 3.0, draft_state="hot")
    with pytest.raises(wb.ConfigError, match="from_cost_model"):
        BatchThreshold.from_cost_model(cm, (3, 1, 5), 3.0)  # a chain forces N = S + 1


def test_recording_policy_records_and_forwards() -> None:
    seen: list[tuple[Decision, float, list[int]]] = []

    class Inner:
        def decide(self, ctx: PolicyContext) -> Decision:
            return Decision(ctx.decode_batch < 3, 2, 2, 4, reason="inner")

        def observe(self, d: Decision, ms: float, accepted: list[int]) -> None:
            seen.append((d, ms, accepted))

    rec = RecordingPolicy(Inner())
    d1 = rec.decide(PolicyContext(0, 2, 2, 2, 4, context_tokens=40))
    rec.observe(d1, 3.5, [1, 0])
    d2 = rec.decide(PolicyContext(1, 5, 2, 2, 4, context_tokens=41))
    rec.observe(d2, 1.5, [])
    assert rec.rows == [StepRecord(2, d1, 3.5, (1, 0), 40), StepRecord(5, d2, 1.5, (), 41)]
    assert d1.speculate and not d2.speculate
    assert seen == [(d1, 3.5, [1, 0]), (d2, 1.5, [])]  # the inner policy still learns


def test_acceptance_rates_telescope_to_tau() -> None:
    """Pooled rates: Π_{j≤d} a_j = #(m ≥ d)/#requests, so 1 + Σ_d Π a_j is exactly τ."""
    accepted = [0, 1, 3, 3, 2, 0, 3]
    rates = depth_rates(accepted, 3)
    tau, p = 1.0, 1.0
    for a in rates:
        p *= a
        tau += p
    assert tau == pytest.approx(1.0 + sum(accepted) / len(accepted))
    assert Acceptance(tau, 0.0, len(accepted)).seed() == {}  # not measured per depth
