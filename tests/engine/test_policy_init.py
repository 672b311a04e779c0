"""Policies the engine resolves on this machine: ``BatchThreshold("auto")`` and ``Goodput()``
without a cost model (engine/policy_init.py; init stage ``policy_costmodel``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import workbench as wb
from workbench.engine import policy_init
from workbench.policy.costmodel import CostModel, LinearCost
from workbench.policy.goodput import Goodput
from workbench.policy.policies import BatchThreshold, PolicyContext

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
SP = wb.SamplingParams(max_new_tokens=6)
CONFIG = wb.EngineConfig(max_batch_size=8)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cache folder per test (autotune's and the policy's)."""
    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    yield tmp_path / policy_init.CACHE_NAME


def stage_detail(e: wb.Engine) -> str:
    (status,) = [st for s, st, _ in e.init_log if s == "policy_costmodel"]
    assert status == "ok"
    return str(e.choices.get("policy_costmodel", {}).get("source", "none"))


def test_auto_threshold_measured_then_cached(cache: Path, micro_target: Path,
                                             random_head: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The step costs are staged (a verify token costs a tenth of a step on top of a plain
    step's fixed cost): timed on the machine, a busy stretch can make a 16-token verify look as
    cheap as a plain step and move n; the acceptance is measured."""
    spec = wb.SpecConfig(policy=BatchThreshold("auto"))
    staged = CostModel(target=LinearCost(a=1.0, b=0.1))
    monkeypatch.setattr(policy_init, "fit_cost_model",
                        lambda engine, batch_sizes, shape: staged)
    with wb.Engine(micro_target, random_head, CONFIG) as e:
        assert stage_detail(e) == "none"  # nothing cached, nothing measured at init
        plain = [o.token_ids for o in e.generate(PROMPTS, SP)]
        out = [o.token_ids for o in e.generate(PROMPTS, SP, spec=spec)]
        assert out == plain  # lossless whatever n came out
        first = dict(e.choices["policy"])
        assert e.choices["policy_costmodel"]["source"] == "measured"
        assert first["policy"].startswith("BatchThreshold(n=") and "decode batch" in \
            first["reason"]
        assert cache.is_file()
    # a random head accepts nothing (τ 1): speculation never pays, n = 0
    assert first["policy"] == "BatchThreshold(n=0)"

    def must_not_measure(*a: object, **k: object) -> CostModel:
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(policy_init, "fit_cost_model", must_not_measure)
    with wb.Engine(micro_target, random_head, CONFIG) as e:
        assert stage_detail(e) == "cached"  # the init stage loaded it: second start instant
        e.set_spec(spec)
        assert isinstance(e.spec.policy, BatchThreshold) and e.spec.policy.n == 0
        assert e.choices["policy"]["policy"] == first["policy"]
        assert e.choices["policy"]["cost_model"] == "cached"


def test_a_busy_calibration_is_provisional_and_never_cached(
        cache: Path, micro_target: Path, random_head: Path,
        machine_conditions: dict[str, float]) -> None:
    spec = wb.SpecConfig(policy=BatchThreshold("auto"))
    machine_conditions["others"] = 1.5  # a neighbour used 1.5 cores during the calibration
    with wb.Engine(micro_target, random_head, CONFIG) as e:
        e.set_spec(spec)
        cm = e.choices["policy_costmodel"]
        assert cm["source"] == "measured" and cm["provisional"] is True
        assert cm["conditions"]["others"] == 1.5
    assert not cache.exists()  # used for that run, never written as final
    machine_conditions["others"] = 0.0
    with wb.Engine(micro_target, random_head, CONFIG) as e:
        assert stage_detail(e) == "none"  # the next quiet start measures again
        e.set_spec(spec)
        assert e.choices["policy_costmodel"]["provisional"] is False
    assert cache.is_file()


def test_goodput_gets_the_cost_model_and_measured_acceptance(cache: Path, micro_target: Path,
                                                             random_head: Path) -> None:
    spec = wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, policy=Goodput(min_dwell=2))
    with wb.Engine(micro_target, random_head, CONFIG) as e:
        e.set_spec(spec)
        g = e.spec.policy
        assert isinstance(g, Goodput) and g is not spec.policy and g.min_dwell == 2
        assert isinstance(g.cost_model, CostModel)
        assert g.accept_seed == {2: (0.0,)}  # measured: the random head accepts nothing
        assert "acceptance seeded" in e.choices["policy"]["reason"]
        plain = [o.token_ids for o in e.generate(PROMPTS, SP)]
        assert [o.token_ids for o in e.generate(PROMPTS, SP, spec=spec)] == plain


def test_calibration_failure_names_the_stage(cache: Path, micro_target: Path,
                                             random_head: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: object, **k: object) -> CostModel:
        raise RuntimeError("timer broke")

    monkeypatch.setattr(policy_init, "fit_cost_model", broken)
    with wb.Engine(micro_target, random_head, CONFIG) as e:
        before = e.spec
        with pytest.raises(wb.ConfigError, match="policy_costmodel: calibration failed: "
                                                  "RuntimeError: timer broke"):
            e.set_spec(wb.SpecConfig(policy=BatchThreshold("auto")))
        assert e.spec is before and not cache.exists()
        rid = e.add_request([5, 6, 7], SP)
        with pytest.raises(wb.ConfigError, match="policy_costmodel: .*1 live request"):
            policy_init.calibrate(e)
        e.abort(rid)


def test_integer_threshold_and_other_policies_untouched(cache: Path, micro_target: Path,
                                                        random_head: Path) -> None:
    with wb.Engine(micro_target, random_head, CONFIG) as e:
        spec = wb.SpecConfig(policy=BatchThreshold(3))
        e.set_spec(spec)
        assert e.spec is spec and "policy" not in e.choices and not cache.exists()


def test_unresolved_placeholders_refuse_to_decide() -> None:
    ctx = PolicyContext(0, 1, 5, 4, 16)
    with pytest.raises(wb.ConfigError, match="BatchThreshold.n: 'auto' is resolved"):
        BatchThreshold("auto").decide(ctx)
    with pytest.raises(wb.ConfigError, match="Goodput.cost_model"):
        Goodput().decide(ctx)
    with pytest.raises(wb.ConfigError, match="BatchThreshold.n"):
        BatchThreshold("fast")  # type: ignore[arg-type]
    assert BatchThreshold("auto").needs_engine and not BatchThreshold(2).needs_engine
    cm = CostModel(target=LinearCost(a=1.0))
    g = Goodput(candidates=[(3, 1, 4)], probe_every=5).resolved(cm, {1: [0.5, 0.5]})
    assert not g.needs_engine and g.candidates == ((3, 1, 4),) and g.probe_every == 5
    assert g.accept_seed == {1: (0.5, 0.5)} and g.cost_model is cm


def test_sglang_launch_refuses_an_unresolved_policy() -> None:
    """A remote SGLang server has no local engine to resolve "auto" on: refused, named."""
    from workbench.remote.launch import launch_plan

    for policy in (BatchThreshold("auto"), Goodput()):
        with pytest.raises(wb.ConfigError, match="spec.policy: .* resolved by a local engine"):
            launch_plan("org/target", "org/draft", spec=wb.SpecConfig(num_steps=3, topk=1,
                                                                      policy=policy))
