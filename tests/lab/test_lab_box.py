"""The box: fitting a replayable run from `bench threshold --url` output and SGLang's own
request records, and compiling a policy to a tier file that SGLang's parser and router read
back as we route it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workbench.errors import ConfigError
from workbench.lab.boxreplay import BoxRun, check_tiers, compile_tiers, fit_box, geometric_rate
from workbench.lab.replay import load_run, replay
from workbench.policy.goodput import tau_of
from workbench.policy.policies import depth_rates
from workbench.remote.records import read_request_metrics

REMOTE = Path(__file__).resolve().parents[1] / "remote"
sys.path.insert(0, str(REMOTE))
from sglang_records import load_writer, meta_info, request_params  # noqa: E402

SHAPE = (3, 1, 4)
LEVELS = (1, 4, 16, 32)
PLAIN_MS = {c: 20.0 + 0.5 * c for c in LEVELS}  # the box's true plain step


def spec_ms(c: int, tau: float) -> float:
    """The box's true speculative step: target(4c) + 2 drafts of c rows + the extend of c·τ."""
    return 20.0 + 0.5 * 4 * c + 2 * (1.0 + 0.2 * c) + (1.0 + 0.2 * c * tau)



def _records(folder: Path, n: int = 24, seed: int = 0) -> list[int]:
    """SGLang-written records of a static S=3 chain server; returns every round's correct
    drafts."""
    writer = load_writer()
    rng = random.Random(seed)
    lines, all_rounds = [], []
    for i in range(n):
        rounds, emitted = [], 1
        while emitted < 48:
            k = 0
            while k < 3 and rng.random() < (0.8, 0.6, 0.5)[k]:
                k += 1
            k = min(k, 48 - emitted - 1)
            rounds.append(k)
            emitted += k + 1
        all_rounds += rounds
        meta = meta_info(f"r{i}", 30 + i % 7, rounds, completion=emitted,
                         finish={"type": "length", "length": emitted}, num_draft_tokens=4,
                         e2e=1.0, sent_ts=1000.0 + i)
        lines.append(writer.line(request_params(f"r{i}", f"p{i}", 48), meta))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sglang-request-metrics-20261201_08.log").write_text("".join(lines))
    return all_rounds


def _threshold(tau: float, prompt: float = float(np.mean([30 + i % 7 for i in range(24)])),
               out: float = 48.0) -> dict:
    """A sweep's tok/s on that box: closed loops whose requests each pay their prefill once
    (target(P); + the draft's extend of it when speculating) beside the decode steps."""
    rows = []
    for c in LEVELS:
        plain = out * PLAIN_MS[c] + c * (20.0 + 0.5 * prompt)
        spec = out / tau * spec_ms(c, tau) + c * (20.0 + 0.5 * prompt + 1.0 + 0.2 * prompt)
        rows.append({"arm": "baseline", "concurrency": c, "tok_s": 1e3 * c * out / plain})
        rows.append({"arm": "eagle3", "concurrency": c, "tok_s": 1e3 * c * out / spec,
                     "tau": tau})
    return {"rows": rows, "threshold": {}}


def test_fit_box_from_records_and_sweeps(tmp_path: Path) -> None:
    rounds = _records(tmp_path / "records")
    df = read_request_metrics(tmp_path / "records")
    want = depth_rates(rounds, 3)
    tau = tau_of(want)
    run = fit_box(_threshold(tau), df, SHAPE)
    assert run.rates == pytest.approx(want)
    assert run.output_lens == df["output_len"].tolist()
    from workbench.policy.costmodel import CostModel

    cm = CostModel.from_dict(run.cost_model)
    for c in LEVELS:  # the fitted model gives back the box's step times
        assert cm.plain_step_ms(c, warm=False) == pytest.approx(PLAIN_MS[c], rel=1e-6)
        assert cm.spec_step_ms(c, *SHAPE, tau=tau) == pytest.approx(spec_ms(c, tau), rel=1e-6)
    # modelled acceptance: the measured shape's draws reproduce the rates
    m = run.accept_table(SHAPE)
    for d, (got, a) in enumerate(zip(depth_rates(m.tolist(), 3), want, strict=True), 1):
        reached = int((m >= d - 1).sum())  # within 4 standard errors of a binomial rate
        assert abs(got - a) <= 4 * (a * (1 - a) / reached) ** 0.5, (d, got, a)
    # deeper shapes accept a superset (one draw per depth, shared by every policy)
    assert (run.accept_table((5, 1, 6)) >= m).all()
    run.check((5, 1, 6), "x")
    assert any("depths 4..5" in n for n in run.notes)
    # saved, loaded, replayed like a recording (SGLang's arm included)
    run.save(tmp_path / "box")
    back = load_run(str(tmp_path / "box"))
    assert isinstance(back, BoxRun) and back.rates == run.rates
    res, _ = replay(back, "always,threshold:auto,sglang,vllm", [1, 16])
    assert set(res["policy"]) >= {"always", "sglang", "oracle"} and res["tok_s"].gt(0).all()


def test_fit_box_from_aggregates_only(tmp_path: Path) -> None:
    _records(tmp_path / "records")
    df = read_request_metrics(tmp_path / "records")
    df["accept_lengths"] = [[] for _ in range(len(df))]  # only per-request τ survives
    run = fit_box(_threshold(3.0), df, SHAPE)
    assert len(set(run.rates)) == 1 and run.notes
    assert tau_of(run.rates) == pytest.approx(float(np.nanmean(df["tau"])), abs=1e-6)
    assert geometric_rate(1.0, 3) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ConfigError, match="τ 5.000 outside"):
        geometric_rate(5.0, 3)
    with pytest.raises(ConfigError, match="--records"):
        fit_box(_threshold(3.0), df.iloc[:0], SHAPE)
    with pytest.raises(ConfigError, match="two or more levels"):
        fit_box({"rows": [{"arm": "baseline", "concurrency": 1, "tok_s": 5.0}]}, df, SHAPE)


def test_tiers_checked_by_sglangs_parser_and_router(tmp_path: Path) -> None:
    """A policy that varies its steps at some batch sizes compiles to candidate lists; SGLang's
    ``prepare_server_args`` accepts the launch (adaptive on) and its router sends every batch
    size where ours does (tests/remote/sglang_oracle.py, in its own process)."""
    steps = ([(1, "S5K1N6", 1.0, 6)] * 40 + [(1, "S3K1N4", 1.0, 4)] * 10
             + [(4, "S3K1N4", 1.0, 4)] * 30 + [(8, "off", 1.0, 8)] * 20
             + [(8, "S1K1N2", 1.0, 8)] * 5 + [(16, "off", 1.0, 16)] * 50
             + [(2, "S5K4N16", 1.0, 9)] * 3)
    tiers, notes = compile_tiers(steps, 24)
    # batch 1 varies (candidates), 2 ran a tree (as a chain upstream), 3 and 5-7 were never
    # seen (the smaller neighbour's), 8 varies between off and 1 step
    assert dict(tiers.tiers) == {1: (3, 5), 2: (5,), 4: (3,), 8: (0, 1), 16: (0,)}
    assert notes and "chain" in notes[0]
    path = tmp_path / "tiers.json"
    rows = check_tiers(tiers, path, 24)
    assert rows[0]["candidates"] == [3, 5] and rows[15]["candidates"] == [0]
    argv = ["--model-path", "/m/t", "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", "/m/d", "--speculative-num-steps", "5",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "6",
            "--speculative-adaptive", "--speculative-adaptive-config", str(path)]
    req = {"plans": [{"cwd": str(tmp_path), "argv": argv, "max_batch": 24}]}
    r = subprocess.run([sys.executable, str(REMOTE / "sglang_oracle.py")],
                       input=json.dumps(req), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])["plans"][0]
    assert out["exit"] is None and out["error"] is None, out
    assert out["resolved"]["speculative_adaptive"] is True
    for b, (padded, tier, steps_run) in enumerate(out["routes"], 1):
        ours = tiers.route(b, None, 5)
        assert (padded, tier, steps_run) == (b, ours.tier, ours.steps), b
    bad = tmp_path / "bad.json"
    with pytest.raises(ConfigError, match="every tier is off"):
        check_tiers(compile_tiers([(1, "off", 1.0, 1)], 4)[0], bad, 4)
