"""``bench load``: the competitor it starts is pinned and always stopped; the goals follow the
figures; an alone phase that was itself busy cannot decide them; the CLI saves it all."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest

import workbench as wb
from workbench.__main__ import main
from workbench.bench import load
from workbench.engine import affinity
from workbench.errors import ConfigError

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="bench load pins a competitor beside the engine: needs 2 cores")


def test_competitor_is_pinned_and_stopped() -> None:
    c = load.Competitor()
    with c:
        assert c.running and c.proc is not None
        assert os.sched_getaffinity(c.proc.pid) == {max(os.sched_getaffinity(0))}
        proc = c.proc
    assert not c.running and proc.poll() is not None  # stopped, reaped
    with pytest.raises(RuntimeError, match="boom"), load.Competitor() as c2:
        proc = c2.proc
        raise RuntimeError("boom")
    assert proc is not None and proc.poll() is not None  # stopped when the block raised
    with pytest.raises(ConfigError, match="core 4096 is not one of"):
        load.Competitor(core=4096)


def test_competitor_takes_the_cores_the_process_started_with() -> None:
    """An engine that started on a busy machine pins its threads to fewer cores (seen: the
    init stage chose one thread under host steal, and `bench load` refused to start with "this
    process may use 1 core(s)"). The competitor still has the process's starting cores."""
    home = affinity.HOME
    assert home is not None
    affinity.pin(1, [min(home)])
    try:
        assert len(os.sched_getaffinity(0)) == 1
        with load.Competitor() as c:
            assert c.core == max(home) and c.proc is not None
            assert os.sched_getaffinity(c.proc.pid) == {max(home)}
    finally:
        affinity.pin(len(home), None)
    assert os.sched_getaffinity(0) == set(home)


def _rows(alone: tuple[float, float], busy: tuple[float, float]) -> pd.DataFrame:
    rows = []
    for cond, (b, e) in (("alone", alone), ("competing", busy)):
        rows += [{"condition": cond, "arm": "baseline", "tokens": 100, "seconds": 100 / b,
                  "lossless": True},
                 {"condition": cond, "arm": "eagle3", "tokens": 100, "seconds": 100 / e,
                  "lossless": True}]
    return pd.DataFrame(rows)


def test_goals_follow_the_figures() -> None:
    summary, goals = load.summarize(_rows((100.0, 200.0), (80.0, 150.0)))
    g = goals.set_index("goal")
    assert g.loc["baseline tok/s competing / alone", "figure"] == pytest.approx(0.8)
    assert g.loc["eagle3 tok/s competing / alone", "figure"] == pytest.approx(0.75)
    assert goals["met"].tolist() == [True, True, True]  # ratio 1.875 vs 2.0: -6 %
    assert summary.set_index(["condition", "arm"]).loc[("competing", "eagle3"), "speedup"] == \
        pytest.approx(1.875)
    _, goals = load.summarize(_rows((100.0, 200.0), (20.0, 25.0)))
    assert goals["met"].tolist() == [False, False, False]  # the collapse the issue saw


def test_busy_alone_phases_cannot_decide_the_goals() -> None:
    summary, goals = load.summarize(_rows((100.0, 200.0), (80.0, 150.0)))
    phases = [{"condition": "alone", "conditions": {"contended": True, "others": 1.7}},
              {"condition": "competing", "conditions": {"contended": True, "others": 2.0}}]
    goals["assessable"] = False
    res = load.LoadBenchResult(pd.DataFrame(), summary, goals, phases)
    assert load.verdict(res).startswith("goals not assessable: the alone phases were "
                                        "themselves contended (other processes used 1.7 cores)")
    goals["assessable"] = True
    assert load.verdict(res) == "every goal met"


def test_bench_load_cli(micro_target: Path, random_head: Path, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[load.Competitor] = []

    class Recorded(load.Competitor):
        def start(self) -> load.Competitor:
            started.append(self)
            return super().start()

    monkeypatch.setattr(load, "Competitor", Recorded)
    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    out = tmp_path / "res"
    argv = ["bench", "load", "--model", str(micro_target), "--draft", str(random_head),
            "--prompts", "2", "--max-new-tokens", "4", "--spec", "2,2,4", "--out", str(out)]
    assert main(argv) == 0
    assert len(started) == 1 and not started[0].running  # one competing phase, stopped
    doc = json.loads((out / "load.json").read_text())
    assert [p["condition"] for p in doc["phases"]] == ["alone", "competing"]
    assert {g["goal"].split(" ")[0] for g in doc["goals"]} == {"baseline", "eagle3",
                                                               "EAGLE-3/baseline"}
    assert all(r["lossless"] for r in doc["summary"])
    assert "conditions" in doc and doc["conditions"]["choices"]
    table = pd.read_csv(out / "load.csv")
    assert set(table["condition"]) == {"alone", "competing"}


def test_which_arm_goes_first_alternates_and_losslessness_holds_either_way() -> None:
    """A phase's start (the engine noticing the competitor) must not always fall on the
    baseline: the first arm alternates by prompt and by repeat; every arm is still compared
    with the baseline's tokens, also when it ran first."""
    calls: list[str] = []
    spec = wb.SpecConfig(num_steps=2, topk=1)

    class Fake:
        def generate(self, prompts: list[Any], sp: object, spec: object = None) -> list[Any]:
            arm = "baseline" if spec is None else "eagle3"
            calls.append(arm)
            wrong = arm == "eagle3" and prompts[0] == [3]  # one prompt's drafts disagree
            return [SimpleNamespace(token_ids=[9] if wrong else [1, 2])]

    arms: dict[str, wb.SpecConfig | None] = {"baseline": None, "eagle3": spec}
    sp = wb.SamplingParams(max_new_tokens=2)
    rows = load._phase(Fake(), [[1], [2], [3]], arms, sp, 0, "alone",  # type: ignore[arg-type]
                       repeat=0)
    assert calls == ["baseline", "eagle3", "eagle3", "baseline", "baseline", "eagle3"]
    assert [(r["prompt"], r["arm"], r["lossless"]) for r in rows] == [
        (0, "baseline", True), (0, "eagle3", True), (1, "baseline", True),
        (1, "eagle3", True), (2, "baseline", True), (2, "eagle3", False)]
    calls.clear()
    load._phase(Fake(), [[1]], arms, sp, 1, "competing", repeat=1)  # type: ignore[arg-type]
    assert calls == ["eagle3", "baseline"]
