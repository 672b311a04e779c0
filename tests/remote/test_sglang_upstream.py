"""Launch plans proven against SGLang 0.5.23's own code (``sglang_oracle.py``, a subprocess):
every plan parses with ``prepare_server_args`` (no SystemExit), SGLang's adaptive resolution
leaves the speculative fields the plan claims, and SGLang's ``AdaptiveSpeculativeParams`` loaded
from the plan's config file routes every batch size as ``plan.routing_rows()`` says."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from plans import CATALOGUE, PRODUCED, make_plan

from workbench.remote.adaptive import spec_decode_capture_sizes
from workbench.remote.launch import LaunchPlan

# skipped only outside `make test`: there (WORKBENCH_SGLANG_CLIENT set) a missing sglang fails
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None and not os.environ.get("WORKBENCH_SGLANG_CLIENT"),
    reason="sglang is not installed: `make test` installs sglang==0.5.23 (--no-deps, with the "
           "light packages its parser imports); by hand: make sglang-ref")

ORACLE = Path(__file__).with_name("sglang_oracle.py")
CAPTURE_MAX_BS = [8, 48, 64, 160, 256, 512]


def run_oracle(plans: list[dict[str, Any]], capture_max_bs: list[int] = ()) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SGLANG_LOG_LEVEL": "warning"}
    proc = subprocess.run([sys.executable, str(ORACLE)], input=json.dumps(
        {"plans": plans, "capture_max_bs": list(capture_max_bs)}), capture_output=True,
        text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def oracle_input(plan: LaunchPlan, folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    plan.write_files(folder)
    head = plan.command.index("sglang.launch_server") + 1
    return {"cwd": str(folder), "argv": plan.command[head:],
            "max_batch": len(plan.routing_rows())}


def argv_value(plan: LaunchPlan, flag: str) -> str | None:
    return plan.command[plan.command.index(flag) + 1] if flag in plan.command else None


def check_against_sglang(plan: LaunchPlan, res: dict[str, Any]) -> None:
    assert res["exit"] is None, f"SGLang's parser exited {res['exit']}: {res['error']}"
    assert res["error"] is None, res["error"]
    parsed, resolved = res["parsed"], res["resolved"]
    speculating = plan.num_steps > 0
    assert parsed["speculative_algorithm"] == ("EAGLE3" if speculating else None)
    assert parsed["tp_size"] == int(argv_value(plan, "--tp"))
    if speculating:
        topk = 1 if plan.tiers is not None else plan.spec.topk
        n_tokens = plan.num_steps + 1 if plan.tiers is not None else plan.spec.num_draft_tokens
        assert resolved == {"speculative_adaptive": plan.tiers is not None,
                            "speculative_num_steps": plan.num_steps,
                            "speculative_eagle_topk": topk,
                            "speculative_num_draft_tokens": n_tokens}
    if plan.tiers is not None:
        assert parsed["speculative_adaptive_config"] == plan.adaptive_config_path
        rows = plan.routing_rows()
        assert res["routes"] == [[r["padded"], r["tier"], r["sglang_steps"]] for r in rows]
    else:
        assert res["routes"] is None
    explicit = argv_value(plan, "--max-running-requests")
    assert parsed["max_running_requests"] == (None if explicit is None else int(explicit))
    if plan.capture_bs is not None:
        assert parsed["cuda_graph_bs_decode"] == list(plan.capture_bs)
    assert parsed["export_metrics_to_file"] == (plan.export_dir is not None)
    assert parsed["export_metrics_to_file_dir"] == plan.export_dir


def raw_cases(folder: Path) -> list[dict[str, Any]]:
    """Launch lines the plans avoid, to show what SGLang does with them (see the test)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiers.json").write_text('{"1": {"candidate_steps": [5]}, '
                                       '"9": {"candidate_steps": [0]}}')
    base = ["--model-path", "/m/t", "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", "/m/d", "--speculative-adaptive",
            "--speculative-adaptive-config", "tiers.json"]
    cases = [base + ["--speculative-num-steps", "5", "--speculative-eagle-topk", "4",
                     "--speculative-num-draft-tokens", "16"],
             base + ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", "4"],
             base + ["--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", "16"],
             ["--model-path", "/m/t", "--cuda-graph-max-bs", "64"],
             ["--model-path", "/m/t", "--cuda-graph-bs", "1", "2"]]
    return [{"cwd": str(folder), "argv": a, "max_batch": 12} for a in cases]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One SGLang subprocess for the module: the catalogue, the raw cases, and every plan the
    backend tests built before this module ran (pytest runs this file last in the folder)."""
    root = tmp_path_factory.mktemp("sglang-plans")
    earlier: dict[tuple, LaunchPlan] = {}
    for p in PRODUCED:
        earlier.setdefault((tuple(p.command), tuple(sorted(p.files.items()))), p)
    plans = {name: make_plan(*args, **kwargs) for name, args, kwargs in CATALOGUE}
    inputs = [oracle_input(p, root / name) for name, p in plans.items()]
    inputs += [oracle_input(p, root / f"produced-{i}") for i, p in enumerate(earlier.values())]
    raw = raw_cases(root / "raw")
    out = run_oracle(inputs + raw, CAPTURE_MAX_BS)
    res = out["plans"]
    k = len(plans)
    return {"plans": dict(zip(plans, zip(plans.values(), res[:k], strict=True), strict=True)),
            "produced": list(zip(earlier.values(), res[k:k + len(earlier)], strict=True)),
            "raw": res[k + len(earlier):], "capture_sizes": out["capture_sizes"]}


@pytest.mark.parametrize("name", [c[0] for c in CATALOGUE])
def test_catalogue_plan_parses_and_routes(oracle: dict[str, Any], name: str) -> None:
    plan, res = oracle["plans"][name]
    check_against_sglang(plan, res)


def test_padding_cases_are_sglangs(oracle: dict[str, Any]) -> None:
    """Threshold 9 is exact without a capture list and pads past the boundary with one."""
    plan, res = oracle["plans"]["threshold-9-no-list"]
    assert plan.differ == () and res["routes"][8] == [9, 1, 5] and res["routes"][9] == [10, 10, 0]
    plan, res = oracle["plans"]["threshold-9-spec-list"]
    assert plan.differ == (9,) and plan.proposed_thresholds == (8, 10)
    assert res["routes"][8] == [10, 10, 0]  # batch 9 pads to 10: plain, the policy drafts
    plan, res = oracle["plans"]["threshold-list-graph-off"]
    assert plan.capture_bs is None and res["routes"][8] == [9, 1, 5]


def test_default_capture_sizes_are_sglangs(oracle: dict[str, Any]) -> None:
    for m in CAPTURE_MAX_BS:
        assert spec_decode_capture_sizes(m) == oracle["capture_sizes"][str(m)]


def test_sglang_behaviour_the_plans_rely_on(oracle: dict[str, Any]) -> None:
    """Why the plan refuses topk != 1, renames the short graph flags and keeps num_steps among
    the candidates: what SGLang itself does otherwise."""
    topk4, steps3, n16, max_bs, bs = oracle["raw"]
    assert topk4["resolved"]["speculative_adaptive"] is False  # silent static fallback
    assert "not in the adaptive config candidate_steps" in steps3["error"]
    assert n16["resolved"]["speculative_num_draft_tokens"] == 6  # forced to steps + 1
    assert max_bs["exit"] == 2 and "ambiguous" in max_bs["error"]
    assert bs["exit"] == 2 and "ambiguous" in bs["error"]


def test_every_plan_the_tests_produced_parses(oracle: dict[str, Any]) -> None:
    """Every plan the other backend test modules built (plans.make_plan) before this one."""
    for plan, res in oracle["produced"]:
        check_against_sglang(plan, res)
