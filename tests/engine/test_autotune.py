"""The ``autotune`` init stage: measured choices on the real weights, cached per machine kind
and model (a second start reads the cache), forced choices kept, outputs unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import busy_provisional

import workbench as wb
from workbench.engine import autotune
from workbench.trace.tracer import RecordingTracer


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "autotune.json"
    monkeypatch.setenv(autotune.ENV_CACHE, str(path))
    return path


def _stage(rec: RecordingTracer, name: str) -> object:
    (s,) = [x for x in rec.of("InitStage") if x.stage == name]
    return s


def test_measured_then_cached(cache: Path, micro_target: Path) -> None:
    rec = RecordingTracer()
    e = wb.Engine(micro_target, config=wb.EngineConfig(), tracer=rec)
    try:
        gemm = e.choices["gemm"]
        assert gemm["source"] == "measured" and gemm["choice"] in ("dense", "onednn")
        assert set(gemm["timings_ms"]) == {"dense", "onednn"}
        assert set(gemm["timings_ms"]["dense"]) == set(autotune.SHAPES)
        assert e.runner.target.gemm == gemm["choice"]
        stage = _stage(rec, "autotune")
        assert stage.status == "ok" and f"gemm={gemm['choice']} (measured" in stage.detail
        assert e.choices["attention"]["choice"] == "torch"
        first = e.generate([[5, 6, 7, 8]], wb.SamplingParams(max_new_tokens=6))[0].token_ids
    finally:
        e.close()
    doc = json.loads(cache.read_text())
    (entry,) = doc["entries"].values()
    assert entry["gemm"]["choice"] == gemm["choice"]
    rec2 = RecordingTracer()
    with wb.Engine(micro_target, config=wb.EngineConfig(), tracer=rec2) as e2:
        assert e2.choices["gemm"]["source"] == "cached"
        assert e2.choices["gemm"]["choice"] == gemm["choice"]
        assert "(cached" in _stage(rec2, "autotune").detail
        again = e2.generate([[5, 6, 7, 8]], wb.SamplingParams(max_new_tokens=6))[0].token_ids
    assert again == first


@pytest.mark.parametrize("gemm", ["dense", "onednn"])
def test_forced_choice_is_not_measured(cache: Path, micro_target: Path, gemm: str) -> None:
    with wb.Engine(micro_target, config=wb.EngineConfig(gemm=gemm, row_floor=1)) as e:
        assert e.choices["gemm"] == {**e.choices["gemm"], "choice": gemm, "source": "forced"}
        assert e.runner.target.gemm == gemm
        # the row floor: forced on oneDNN weights, none (only 1) on dense ones
        assert e.choices["rows"]["source"] == ("forced" if gemm == "onednn" else "only")
        assert e.runner.target.row_floor == 1
    assert not cache.exists()  # nothing measured, nothing cached


def test_cache_key_follows_the_model(cache: Path, micro_target: Path, tmp_path: Path) -> None:
    with wb.Engine(micro_target) as e:
        key = autotune.cache_key(e)
        other = json.loads(key)
        assert other["cpu"] and other["torch"] == torch.__version__
        assert other["target"] == autotune.model_fingerprint(micro_target, e.runner.target)


def test_corrupt_cache_is_ignored_and_rewritten(cache: Path, micro_target: Path) -> None:
    cache.write_text("{not json")
    with wb.Engine(micro_target) as e:
        assert e.choices["gemm"]["source"] == "measured"
    assert json.loads(cache.read_text())["entries"]


def test_cache_off(monkeypatch: pytest.MonkeyPatch, micro_target: Path) -> None:
    monkeypatch.setenv(autotune.ENV_CACHE, "off")
    assert autotune.cache_path() is None
    with wb.Engine(micro_target) as e:
        assert e.choices["gemm"]["source"] == "measured"


def test_pick_prefers_default_within_margin() -> None:
    t = {"dense": {"a": 1.0, "b": 2.0}, "onednn": {"a": 0.99, "b": 1.98}}
    assert autotune.pick(t, "dense") == "dense"
    t["onednn"] = {"a": 0.5, "b": 1.0}
    assert autotune.pick(t, "dense") == "onednn"
    # weighted: a big loss at the heavy shape outweighs a win at a light one
    t = {"dense": {"x": 1.0, "y": 1.0}, "onednn": {"x": 2.0, "y": 0.8}}
    assert autotune.pick(t, "dense", weights={"x": 2.0, "y": 0.5}) == "dense"


def test_interleaved_min_takes_turns_and_the_least_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The calls' durations are staged on the module's clock (a real sleep on a busy machine
    oversleeps, which would decide the case instead of the rule)."""
    order: list[str] = []
    now = [0.0]
    monkeypatch.setattr(autotune, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def a() -> None:
        order.append("a")
        # 1 ms a call; the first timed call hits a busy stretch of 30 ms
        now[0] += 0.030 if order.count("a") == 2 else 0.001

    def b() -> None:
        order.append("b")
        now[0] += 0.002

    ms = autotune.interleaved_min_ms({"a": a, "b": b}, budget_s=0.0, min_rounds=4)
    assert order == ["a", "b"] + ["a", "b"] * 4  # one warm-up each, then turns
    assert ms == {"a": pytest.approx(1.0), "b": pytest.approx(2.0)}  # the spike is not the figure


def test_a_busy_machine_makes_a_provisional_choice_never_cached(
        cache: Path, micro_target: Path, machine_conditions: dict[str, float],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule: a choice measured under contention is used for that run, named provisional
    with the conditions it was measured at, never written as final; the next quiet start
    measures again and only that verdict is cached and read back."""
    from workbench.engine import contention

    # thread counts time alike, so a busy start keeps the process's count: the cache key
    # (which names the thread count) is then the quiet start's, whatever the real timings
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0, pin=None:
                        {n: {"p": 1.0} for n in cands})
    machine_conditions["others"] = 1.2  # a neighbour used 1.2 cores while we measured
    with wb.Engine.from_pretrained(micro_target) as e:
        gemm = e.choices["gemm"]
        assert gemm["source"] == "measured" and gemm["provisional"] is True
        assert gemm["conditions"]["others"] == 1.2 and gemm["conditions"]["contended"]
        assert gemm["conditions"]["cpu"] and gemm["conditions"]["time"]
        assert e.runner.target.gemm == gemm["choice"]  # used for this run
        assert autotune.provisional_names(e.choices) == busy_provisional()
        assert "PROVISIONAL" in autotune.conditions_line(e.choices)
    assert not autotune.read_cache(cache)  # nothing final was measured: nothing cached
    with wb.Engine.from_pretrained(micro_target) as e:  # still busy: measured again
        assert e.choices["gemm"]["source"] == "measured" and e.choices["gemm"]["provisional"]
    machine_conditions["others"] = 0.0  # the next quiet start
    with wb.Engine.from_pretrained(micro_target) as e:
        assert (e.choices["gemm"]["source"], e.choices["gemm"]["provisional"]) == \
            ("measured", False)
        quiet = e.choices["gemm"]
    (entry,) = autotune.read_cache(cache).values()
    assert entry["gemm"]["provisional"] is False
    machine_conditions["others"] = 1.2  # busy again: the quiet verdict is read back
    with wb.Engine.from_pretrained(micro_target) as e:
        assert e.choices["gemm"]["source"] == "cached"
        assert e.choices["gemm"]["choice"] == quiet["choice"]
        assert e.choices["gemm"]["conditions"]["time"] == quiet["conditions"]["time"]
        # the GEMM verdict is final; a thread count (where there is one to adapt) still
        # answers the moment's load
        assert autotune.provisional_names(e.choices) == \
            [n for n in busy_provisional() if n != "gemm"]


def test_a_provisional_cache_entry_is_never_read_back_as_final(
        cache: Path, micro_target: Path) -> None:
    with wb.Engine.from_pretrained(micro_target) as e:
        key = autotune.cache_key(e)
    planted = autotune.Choice("gemm", "onednn", "measured", ("dense", "onednn"),
                              provisional=True).to_dict()
    autotune.replace_cache(cache, {key: {"gemm": planted}}, autotune.CACHE_VERSION)
    with wb.Engine.from_pretrained(micro_target) as e:
        assert e.choices["gemm"]["source"] == "measured"  # not "cached"
    assert autotune.final(planted) is None
    assert autotune.final({**planted, "provisional": False}) is not None
    # write_cache refuses provisional choices outright
    autotune.write_cache(cache, "k", {"gemm": autotune.Choice("gemm", "dense", "measured",
                                                               provisional=True)})
    assert "k" not in autotune.read_cache(cache)


def test_choice_records_name_where_and_at_what_load() -> None:
    cond = {"cores": 2, "window_s": 1.0, "others": 0.9, "steal": 0.0, "load1": 1.4,
            "drift": None, "time": "2026-12-01 14:40:00", "contended": True, "cpu": "AMD EPYC"}
    choices = {
        "gemm": autotune.Choice("gemm", "onednn", "measured", provisional=True,
                                conditions=cond).to_dict(),
        "attention": autotune.Choice("attention", "torch", "only").to_dict(),
    }
    recs = autotune.choice_records(choices)
    assert recs[0] == {"name": "gemm", "choice": "onednn", "source": "measured",
                       "provisional": True, "measured_at": "2026-12-01 14:40:00",
                       "cpu": "AMD EPYC", "cores": 2, "load1": 1.4, "others": 0.9,
                       "steal": 0.0}
    assert recs[1]["provisional"] is False and recs[1]["measured_at"] is None
    line = autotune.conditions_line(choices)
    assert line.startswith("gemm=onednn (measured 2026-12-01 14:40:00, AMD EPYC, load 1.4, "
                           "others 0.90 of 2 cores: PROVISIONAL)")
    assert "attention=torch (only)" in line
    detail = autotune.Choice("gemm", "onednn", "measured", provisional=True,
                             conditions=cond).detail()
    assert "PROVISIONAL, measured busy: other processes used 0.90 of 2 cores" in detail
