"""The replay: the simulator against the bs=1 walk, real policies through decide/observe,
SGLang's and vLLM's controllers, the oracle, the CLI and every bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from labkit import COST, SHAPE

from workbench.errors import ConfigError
from workbench.lab.arms import (
    VLLM_EAGLE3_TABLE,
    ArmInputs,
    SGLangAdaptive,
    make_policy,
    split_policies,
    step_table,
    vllm_table,
)
from workbench.lab.record import RecordedRun
from workbench.lab.replay import measured_acceptance, replay
from workbench.lab.sim import Oracle, Simulator
from workbench.lab.trees import accepted, bs1_accept_lengths, check_recorded
from workbench.policy.goodput import Goodput
from workbench.policy.policies import Always, Decision, Never, PolicyContext, RecordingPolicy

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_bs1_replay_walks_the_recording(recorded: RecordedRun) -> None:
    """c=1 with Always: the simulator's verifies are the bs=1 walk's, and every output
    token is accounted for (1 from prefill + Σ τ + plain steps)."""
    sim = Simulator(recorded, COST, SHAPE)
    n = len(recorded.outputs)
    res = sim.run_level(Always(), 1, num_requests=n)
    walk = [e for r in bs1_accept_lengths(recorded, SHAPE) for e in r]
    assert res.row["tau"] == pytest.approx(float(np.mean(walk)))
    assert res.row["tokens"] == sum(len(o) for o in recorded.outputs)
    spec = sum(1 for s in res.steps if s[1] != "off")
    assert spec == len(walk)
    never = sim.run_level(Never(), 1, num_requests=n)
    assert never.row["spec_fraction"] == 0.0
    assert never.row["decode_steps"] == sum(len(o) - 1 for o in recorded.outputs)
    assert res.row["tok_s"] > never.row["tok_s"]  # τ≈4 at bs=1 under this cost model


def test_policies_decide_and_observe(recorded: RecordedRun) -> None:
    """The real Policy objects run: every decode step is decided and observed once, with the
    replayed accepted counts (a RecordingPolicy sees exactly the simulator's steps)."""
    sim = Simulator(recorded, COST, SHAPE)
    acc = measured_acceptance(recorded)
    gp = Goodput(COST.copy(), candidates=[SHAPE, (5, 1, 6), (3, 1, 4)],
                 accept_seed=acc.seed())
    rec = RecordingPolicy(gp)
    res = sim.run_level(rec, 4)
    assert len(rec.rows) == len(res.steps)
    spec_rows = [r for r in rec.rows if r.decision.speculate]
    logged = [m for _, ms in res.accepted for m in ms]
    assert [m for r in spec_rows for m in r.accepted] == logged
    assert gp.probes + gp.switches >= 0 and gp.started  # it decided for itself


def test_oracle_takes_the_best_option() -> None:
    opts = {None: (4, 10.0), (5, 4, 16): (9, 20.0), (3, 1, 4): (8, 14.0)}
    d = Oracle(list(k for k in opts if k)).choose(lambda s: opts[s])
    assert d.shape == (3, 1, 4)  # 8/14 > 9/20 > 4/10
    d = Oracle([(5, 4, 16)]).choose(lambda s: {None: (4, 5.0), (5, 4, 16): (9, 20.0)}[s])
    assert not d.speculate


def test_replay_regret_and_reference_rows(recorded: RecordedRun) -> None:
    df, _ = replay(recorded, "always,threshold:auto,goodput,vllm", [1, 4], num_requests=4)
    assert set(df["policy"]) == {"never", "always", "threshold:auto", "goodput", "vllm",
                                 "oracle"}
    o = df[df["policy"] == "oracle"]
    assert (o["regret"].abs() < 1e-12).all()
    n = df[df["policy"] == "never"]
    assert (n["vs_never"] == 1.0).all() and (n["spec_fraction"] == 0.0).all()
    assert df["basis"].notna().any()  # threshold:auto says why


def test_sglang_arm_is_the_wheels_controller(tmp_path: Path) -> None:
    """Driven side by side with a bare AdaptiveSpeculativeParams on the same inputs, the arm
    makes the same choices (it *is* that class, default tiers and a tier file)."""
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    tiers = tmp_path / "tiers.json"
    tiers.write_text(json.dumps({"1": {"candidate_steps": [1, 3, 5]}, "6": {
        "candidate_steps": [0, 1]}, "ema_alpha": 0.5, "warmup_batches": 2}))
    rng = np.random.default_rng(0)
    for cfg in (None, tiers):
        arm = SGLangAdaptive(5, cfg)
        assert isinstance(arm.params, AdaptiveSpeculativeParams)
        ref = AdaptiveSpeculativeParams(5, None if cfg is None else str(cfg))
        for step in range(200):
            b = int(rng.integers(1, 40))
            d = arm.decide(PolicyContext(step, b, 5, 1, 6))
            steps = ref.get_steps_for_batch(b)
            assert (d.num_steps if d.speculate else 0) == steps
            acc = [int(rng.integers(0, steps + 1)) for _ in range(b)] if steps else [0] * b
            arm.observe(d, 1.0, acc if d.speculate else [])
            ref.on_verify_complete(acc, b)
    with pytest.raises(ConfigError, match="no tier file"):
        SGLangAdaptive(5, tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1": {"candidate_steps": []}}))
    with pytest.raises(ConfigError, match="SGLang refuses"):
        SGLangAdaptive(5, bad)


def test_vllm_table() -> None:
    t = vllm_table()
    for lo, hi, k in VLLM_EAGLE3_TABLE:
        for b in (lo, hi or lo + 100):
            assert t.lookup(b) == (None if k == 0 else (k, 1, k + 1))
    assert vllm_table("1-8=3,9-=0").lookup(9) is None
    with pytest.raises(ConfigError, match="vllm"):
        vllm_table("1-8=x,9-=0")


def test_policy_names() -> None:
    assert split_policies("always,table:1-4=S5K4N16,5-=off,vllm:1-8=3,9-=0,sglang") == [
        "always", "table:1-4=S5K4N16,5-=off", "vllm:1-8=3,9-=0", "sglang"]
    assert step_table("1-4=S5K4N16,5-=off").lookup(5) is None
    with pytest.raises(ConfigError, match="unknown policy 'fastest'"):
        split_policies("always,fastest")
    with pytest.raises(ConfigError, match="S5K4N16"):
        step_table("1-=S5K4")
    with pytest.raises(ConfigError, match="recorded run"):
        make_policy("oracle", ArmInputs(SHAPE, COST))


def test_shape_larger_than_recorded(recorded: RecordedRun) -> None:
    with pytest.raises(ConfigError, match="drafts 6 steps but the run recorded 5"):
        check_recorded(recorded, (6, 4, 16), "shape")
    with pytest.raises(ConfigError, match="top-k 5"):
        check_recorded(recorded, (2, 5, 6), "shape")
    with pytest.raises(ConfigError, match=r"--policy table:1-=S6K2N8.*record a larger"):
        replay(recorded, "table:1-=S6K2N8", [1])
    assert accepted(recorded, (7, 1, 8)).shape == recorded.req.shape  # chains to 7


def test_cli_replay_json(run_dir: Path) -> None:
    r = _cli("lab", "replay", str(run_dir), "--policy", "always,sglang", "--levels", "1,4",
             "--json", "--requests", "4")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert {(x["policy"], x["concurrency"]) for x in rows} == {
        (p, c) for p in ("never", "always", "sglang", "oracle") for c in (1, 4)}
    for x in rows:
        assert {"policy", "concurrency", "tok_s", "tau", "spec_fraction", "regret"} <= set(x)
        assert math.isfinite(x["tok_s"]) and x["tok_s"] > 0


def test_cli_bad_inputs(tmp_path: Path, run_dir: Path) -> None:
    r = _cli("lab", "replay", str(tmp_path / "nothing"))
    assert r.returncode == 1 and "no recorded run there" in r.stderr
    r = _cli("lab", "replay", str(run_dir), "--policy", "always,fastest")
    assert r.returncode == 1 and "unknown policy 'fastest'" in r.stderr
    r = _cli("lab", "replay", str(run_dir), "--policy", "table:1-=S5K4N32")
    assert r.returncode == 1 and "S5K4N32" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    r = _cli("lab", "record", "--prompts-file", str(empty), "--out", str(tmp_path / "run"))
    assert r.returncode == 1 and "empty prompts file" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    r = _cli("lab", "record", "--prompts-file", str(bad), "--out", str(tmp_path / "run"))
    assert r.returncode == 1 and "bad.jsonl:1" in r.stderr
    r = _cli("lab", "record", "--prompts-file", str(bad), "--shape", "5,4,99",
             "--out", str(tmp_path / "run"))
    assert r.returncode == 1 and "--shape" in r.stderr
    for n in ("run.json", "trees.npz"):
        half = tmp_path / f"half-{n}"
        half.mkdir()
        (half / n).write_text("{}")
        r = _cli("lab", "replay", str(half))
        assert r.returncode == 1 and "RUN" in r.stderr, r.stderr


def test_decision_shapes_checked_before_replay(recorded: RecordedRun) -> None:
    """A policy asking for an unrecorded shape fails before anything runs, naming it."""
    with pytest.raises(ConfigError, match="--policy sglang"):
        # a tier file with 9-step chains: deeper than the recorded chains (7)
        path = Path(recorded.path or ".") / "deep.json"
        path.write_text(json.dumps({"1": {"candidate_steps": [9]}}))
        try:
            replay(recorded, f"sglang:{path}", [1])
        finally:
            path.unlink()
    assert Decision(False).shape is None


def test_anchored_step_model(lab_engine, lab_prompts: list[str]) -> None:
    """Measured steps are the anchors: the model gives them back at the measured batches
    (shape, τ and context as measured), interpolates between them, keeps its type through a
    save and a policy's copy, and prices an unmeasured shape from the nearest measured one
    plus the component difference."""
    from workbench.lab.stepfit import AnchoredCostModel, cost_model_from_dict, fit_step_model

    cm = fit_step_model(lab_engine, lab_prompts, (3, 2, 6), contexts=(64,), batches=(1, 2),
                        tokens=10)
    a = cm.anchors
    assert a["batches"] == [1, 2] and min(a["plain_samples"]) > 0
    assert set(a["shapes"]) == {"S3K2N6", "S3K1N4"}  # the recorded shape and its chain
    for i, b in enumerate(a["batches"]):
        assert cm.plain_step_ms(b, a["plain_context"][i], warm=False) == \
            pytest.approx(a["plain"][i])
    for m in a["shapes"].values():
        for i, b in enumerate(m["batches"]):
            assert cm.spec_step_ms(b, *m["shape"], tau=m["tau"][i], context=m["context"][i]) \
                == pytest.approx(m["spec"][i])
    mid = cm.plain_step_ms(1.5, float(np.interp(1.5, [1, 2], a["plain_context"])), warm=False)
    assert mid == pytest.approx((a["plain"][0] + a["plain"][1]) / 2, rel=1e-6)
    back = cost_model_from_dict(json.loads(json.dumps(cm.to_dict())))
    assert isinstance(back, AnchoredCostModel) and back.anchors == cm.anchors
    assert isinstance(cm.copy(), AnchoredCostModel)
    # S2K1N3 was not measured: priced from the measured chain S3K1N4 plus the difference
    ref = a["shapes"]["S3K1N4"]
    assert cm.anchor_for((2, 1, 3)) is ref
    ctx, tau = ref["context"][0], ref["tau"][0]
    assert cm.spec_step_ms(1, 2, 1, 3, tau=2.0, context=ctx) == pytest.approx(
        ref["spec"][0] + cm._components(1, (2, 1, 3), 2.0, ctx)
        - cm._components(1, (3, 1, 4), tau, ctx))
