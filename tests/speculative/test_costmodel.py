"""The cost model's crossover, ``BatchThreshold.from_cost_model``, the one step recorder
(``RecordingPolicy``) and ``measure_tau``: hand-built cost models give exact thresholds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import workbench as wb
from workbench.bench.concurrency import default_arms, policy_bases
from workbench.speculative.costmodel import Acceptance, CostModel, LinearCost, measure_tau
from workbench.speculative.policy import (
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


@pytest.fixture(scope="module")
def engine(micro_target: Path, random_head: Path) -> Iterator[wb.Engine]:
    e = wb.Engine.from_pretrained(micro_target, draft=random_head,
                                  config=wb.EngineConfig(max_batch_size=16))
    yield e
    e.close()


def test_measure_tau_restores_stats_and_frees_kv(engine: wb.Engine) -> None:
    steps_before = dict(engine.stats.steps)
    acc = measure_tau(engine, [[5, 6, 7, 8], [9, 10, 11], [12, 13]], (2, 2, 4),
                      max_new_tokens=6)
    # a random head accepts nothing: every speculating request-step emits the bonus token only
    assert acc.tau == 1.0 and acc.samples > 0 and acc.context > 2
    # the per-depth rates Goodput starts from: depth 1 never accepted, deeper never reached
    assert acc.topk == 2 and acc.rates == (0.0,) and acc.seed() == {2: (0.0,)}
    assert engine.stats.steps == steps_before
    assert engine.kv_usage()["used_blocks"] == 0
    with pytest.raises(wb.ConfigError, match="measure_tau"):
        measure_tau(engine, [], (2, 2, 4))


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


def test_default_arms_threshold_auto_and_forced(engine: wb.Engine) -> None:
    spec = wb.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    arms = default_arms(engine, spec=spec, cost_model=hand_model(), tau=3.0, flips=False)
    th = arms["threshold"]
    assert th is not None and th.policy == BatchThreshold(8) and th.draft_state == "auto"
    basis = policy_bases(arms)
    assert list(basis) == ["threshold"] and basis["threshold"]["n"] == 8
    assert basis["threshold"]["policy"] == "BatchThreshold(n=8)"
    forced = default_arms(engine, spec=spec, cost_model=hand_model(), threshold=4, flips=False)
    assert forced["threshold"] is not None and forced["threshold"].policy == BatchThreshold(4)
    assert policy_bases(forced) == {}
    with pytest.raises(wb.ConfigError, match="prompts= .* or tau="):
        default_arms(engine, spec=spec, cost_model=hand_model(), flips=False)
    with pytest.raises(wb.ConfigError, match="default_arms.threshold"):
        default_arms(engine, spec=spec, cost_model=hand_model(), threshold="8", flips=False)
