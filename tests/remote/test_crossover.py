"""bench threshold against servers (the box's crossover), on the native SGLang-compatible
server standing in for both the baseline and the EAGLE-3 server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plans import PRODUCED
from serve.serving import TEXT_PROMPTS

import workbench as wb
from workbench.bench.threshold import sweep_threshold
from workbench.remote.crossover import split_urls, threshold_rule
from workbench.remote.launch import plan_from_threshold


def test_threshold_rule_is_find_thresholds() -> None:
    base = {1: 50.0, 2: 90.0, 4: 160.0, 8: 300.0}
    assert threshold_rule(base, {1: 100.0, 2: 150.0, 4: 150.0, 8: 200.0}) == (4, 2)
    assert threshold_rule(base, {1: 40.0, 2: 80.0, 4: 150.0, 8: 200.0}) == (1, 0)
    assert threshold_rule(base, {c: v * 2 for c, v in base.items()}) == (None, 8)
    with pytest.raises(wb.ConfigError, match="no concurrency level"):
        threshold_rule(base, {16: 1.0})


def test_split_urls() -> None:
    assert split_urls("http://a:1, http://b:2") == ("http://a:1", "http://b:2")
    with pytest.raises(wb.ConfigError, match="BASELINE_URL,EAGLE3_URL"):
        split_urls("http://a:1")


def test_sweep_threshold_to_launch_plan(server, tmp_path: Path) -> None:
    doc = sweep_threshold(f"{server.url},{server.url}", TEXT_PROMPTS[:2], [1, 2], 4, tmp_path,
                          progress=False)
    saved = json.loads((tmp_path / "threshold.json").read_text())
    assert saved["threshold"] == doc["threshold"]
    assert {(r["arm"], r["concurrency"]) for r in saved["rows"]} == {
        (a, c) for a in ("baseline", "eagle3") for c in (1, 2)}
    assert all(r["tok_s"] > 0 and r["failed"] == 0 for r in saved["rows"])
    plan = plan_from_threshold(tmp_path, "/m/target", "/m/draft",
                               spec=wb.SpecConfig(5, 1, draft_state="warm"))
    n = doc["threshold"]["suggested_n"]
    assert plan.spec.policy == wb.BatchThreshold(n)
    assert plan.notes[0].startswith(f"BatchThreshold({n}) from bench threshold")
    PRODUCED.append(plan)  # parsed by SGLang in test_sglang_upstream
