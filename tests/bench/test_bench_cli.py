"""Every ``bench`` result records machine, load and sanity flags; ``--strict`` turns a flagged
run into exit 2; the run is merged into the machine kind's results file with its command."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from helpers import busy_provisional

from workbench.__main__ import main
from workbench.data_io import load_result_files
from workbench.machine import machine_info


def test_bench_spec_records_machine_load_flags(micro_target: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    out = tmp_path / "res"
    argv = ["bench", "spec", "--model", str(micro_target), "--draft", str(tmp_path / "none"),
            "--prompts", "2", "--max-new-tokens", "4", "--repeats", "2", "--out", str(out),
            "--strict", "--engine", "gemm=dense"]
    code = main(argv)
    doc = json.loads((out / "spec_bs1.json").read_text())
    assert {"machine", "load", "flags", "flagged", "summary", "engine_choices"} <= set(doc)
    assert doc["machine"]["cpu"] and "commit" in doc["machine"] and "l3" in doc["machine"]
    assert len(doc["load"]["before"]) == 3 and len(doc["load"]["after"]) == 3
    assert doc["engine_choices"]["gemm"] == {**doc["engine_choices"]["gemm"],
                                             "choice": "dense", "source": "forced"}
    assert code == (2 if doc["flagged"] else 0)  # --strict: a flagged run exits 2
    table = pd.read_csv(out / "spec_bs1.csv", keep_default_na=False)
    assert "flags" in table and {"tok_s_lo", "tok_s_hi"} <= set(table.columns)
    loaded = any(f["code"] == "loaded" for f in doc["flags"])
    assert all(("loaded" in f) == loaded for f in table["flags"])
    kind = doc["machine"]["kind"]
    assert kind == machine_info()["kind"]  # this machine's kind names the file
    per_machine = json.loads((out / f"{kind}.json").read_text())
    entry = per_machine["benchmarks"]["spec"]
    assert entry["command"].startswith("python -m workbench bench spec")
    assert entry["summary"][0]["arm"] == "baseline"
    assert load_result_files(out)[kind]["machine"]["cpu"] == doc["machine"]["cpu"]


def test_engine_flag_errors_name_the_field(micro_target: Path, tmp_path: Path) -> None:
    argv = ["bench", "spec", "--model", str(micro_target), "--out", str(tmp_path),
            "--engine", "gemm"]
    assert main(argv) == 1
    argv[-1] = "nonsense=1"
    assert main(argv) == 1


def test_spec_bench_reports_the_bound(micro_target: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """P1's bound next to the speedup: verify_ratio and bound = τ / verify_ratio per arm."""
    import workbench as wb
    from workbench.bench.spec import ceiling_lines, run_spec_bench
    from workbench.models.synthetic import write_random_head

    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    head = write_random_head(micro_target, tmp_path / "head", draft_vocab=100)
    arms = {"baseline": None, "tree": wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)}
    with wb.Engine(micro_target, draft=head) as e:
        res = run_spec_bench(e, [[5, 6, 7, 8], [9, 10, 11]], arms=arms, max_new_tokens=8,
                             progress=False, bound=True)
    s = res.summary.set_index("arm")
    assert s.loc["tree", "verify_ratio"] > 0
    assert s.loc["tree", "bound"] == pytest.approx(s.loc["tree", "tau"] /
                                                   s.loc["tree", "verify_ratio"])
    assert pd.isna(s.loc["baseline", "bound"])
    # the ceiling beside the speedup: τ / (verify + drafts) in plain-step units, same run
    tree = s.loc["tree"]
    assert tree["draft_ratio"] > 0 and tree["overhead"] > -1.0
    assert tree["ceiling"] == pytest.approx(tree["tau"] / (tree["verify_ratio"] +
                                                           tree["draft_ratio"]))
    assert tree["of_ceiling"] == pytest.approx(tree["speedup"] / tree["ceiling"])
    assert tree["of_ceiling_step"] == pytest.approx(1.0 / (1.0 + tree["overhead"]))
    line, e2e, phases = ceiling_lines(res.summary)
    assert line.startswith(f"tree: {tree['speedup']:.2f}x. Per decode step: ceiling "
                           f"{tree['ceiling']:.2f}x")
    # the ceilings come from the timed steps themselves: every row's forwards are part of it
    rows = res.per_prompt
    assert (rows["forward_seconds"] > 0).all() and (rows["forward_seconds"] < rows["seconds"]).all()
    # whole prompts: the baseline's seconds over the arm's forwards' seconds
    fwd = rows.groupby("arm")["forward_seconds"].sum()
    assert tree["ceiling_e2e"] == pytest.approx(s.loc["baseline", "seconds"] / fwd["tree"])
    assert tree["of_ceiling_e2e"] == pytest.approx(fwd["tree"] / tree["seconds"])
    assert tree["of_ceiling_e2e"] == pytest.approx(tree["speedup"] / tree["ceiling_e2e"])
    assert 0 < tree["of_ceiling_e2e"] < 1 and tree["prefill_ratio"] > 0
    assert e2e.startswith("  whole prompts (the prefill, ") and "reached" in e2e
    # where the overhead sits, by phase: every phase reported, the tree's and the extend's
    # bookkeeping without their draft forwards
    assert phases.startswith("  overhead ms per step by phase (traced pass): schedule ")
    for k in ("schedule", "tree", "verify", "accept", "commit", "extend", "other"):
        assert f" {k} " in phases and not pd.isna(tree[f"overhead_{k}_ms"])
    for k in ("tree", "accept", "commit", "extend"):
        assert tree[f"overhead_{k}_ms"] > 0.0


def test_forward_clock_times_each_steps_forwards(micro_target: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import workbench as wb
    from workbench.bench.step_cost import ForwardClock
    from workbench.models.synthetic import write_random_head

    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    head = write_random_head(micro_target, tmp_path / "head", draft_vocab=100)
    spec = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    sp = wb.SamplingParams(max_new_tokens=6)
    with wb.Engine(micro_target, draft=head) as e:
        ref = e.generate([[5, 6, 7, 8]], sp, spec=spec)[0].token_ids
        with ForwardClock(e) as clock:
            got = e.generate([[5, 6, 7, 8]], sp, spec=spec)[0].token_ids
        assert got == ref  # timing changes nothing
        assert not {"step"} & set(vars(e)) and "forward" not in vars(e.runner.target)
        assert not {"forward", "features"} & set(vars(e.runner.draft))  # every wrapper removed
        assert not {"_draft", "extend", "prefill"} & set(vars(e.worker))
    assert len(clock.rows) >= 2 and [r["step"] for r in clock.rows] == sorted(
        r["step"] for r in clock.rows)
    for r in clock.rows:
        assert 0.0 < r["target_ms"] + r["draft_ms"] <= r["total_ms"]
        # the draft forwards inside a tree build / an extend are inside its time
        assert 0.0 <= r["tree_fwd_ms"] <= r["tree_ms"] and 0.0 <= r["extend_fwd_ms"] <= \
            r["extend_ms"]
        assert r["tree_fwd_ms"] + r["extend_fwd_ms"] <= r["draft_ms"] + 1e-9
    assert any(r["tree_fwd_ms"] > 0 for r in clock.rows)
    assert any(r["draft_ms"] > 0 for r in clock.rows)  # speculative steps ran the draft
    # the prompt's pass is marked (decode steps are the rest), its target forward inside it
    first = clock.rows[0]
    assert 0.0 < first["prompt_fwd_ms"] <= first["prompt_ms"] <= first["total_ms"]
    assert all(r["prompt_ms"] == 0.0 for r in clock.rows[1:])


def test_strict_refuses_a_run_on_provisional_choices(
        micro_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        machine_conditions: dict[str, float], capsys: pytest.CaptureFixture[str]) -> None:
    """A busy machine: the run says so on its first line, the GEMM choice measured then is
    provisional, the saved result names it with its conditions, and --strict exits 2."""
    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    machine_conditions["others"] = 1.0
    out = tmp_path / "res"
    argv = ["bench", "spec", "--model", str(micro_target), "--draft", str(tmp_path / "none"),
            "--prompts", "2", "--max-new-tokens", "4", "--out", str(out)]
    assert main([*argv, "--strict"]) == 2
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("machine: busy: other processes used 1.00 of ")
    doc = json.loads((out / "spec_bs1.json").read_text())
    codes = {f["code"] for f in doc["flags"]}
    assert {"contended", "provisional_choice"} <= codes
    assert doc["conditions"]["provisional"] == busy_provisional()
    (gemm,) = [r for r in doc["conditions"]["choices"] if r["name"] == "gemm"]
    assert gemm["provisional"] and gemm["others"] == 1.0 and gemm["measured_at"]
    assert doc["conditions"]["at_start"]["contended"] is True
    kind = doc["machine"]["kind"]
    entry = json.loads((out / f"{kind}.json").read_text())["benchmarks"]["spec"]
    assert entry["conditions"]["provisional"] == busy_provisional()
    assert "provisional_choice" in entry["flags"]
    assert all("provisional_choice" in r["flags"] for r in entry["summary"])
    machine_conditions["others"] = 0.0  # quiet: measured again, final, and --strict passes
    assert main([*argv, "--strict"]) in (0, 2)
    doc = json.loads((out / "spec_bs1.json").read_text())
    assert doc["conditions"]["provisional"] == []
    assert not {"contended", "provisional_choice"} & {f["code"] for f in doc["flags"]}


def test_bench_spec_states_a_reduced_dtype_s_effect(micro_target: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26: bf16 is an option with its numerical effect stated, never silently: the run
    prints and saves its speed and its agreement with float32, measured in the same run
    (speculation in bf16 is lossless with row-invariant numerics: batch_invariant)."""
    from workbench.models.synthetic import write_random_head

    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    head = write_random_head(micro_target, tmp_path / "head", draft_vocab=100)
    out = tmp_path / "res"
    argv = ["bench", "spec", "--model", str(micro_target), "--draft", str(head),
            "--prompts", "2", "--max-new-tokens", "6", "--out", str(out),
            "--engine", "dtype=bfloat16,compile=off,batch_invariant=true"]
    main(argv)
    doc = json.loads((out / "spec_bs1.json").read_text())
    eff = doc["dtype_effect"]
    assert eff["dtype"] == "bfloat16" and eff["prompts"] == 2
    assert 0.0 <= eff["agreement"] <= 1.0 and len(eff["agreement_per_prompt"]) == 2
    assert all(0 <= f <= 6 for f in eff["first_divergence"])
    assert 0.0 < eff["max_logit_diff"] < 10.0  # bf16 rounds: never exactly float32's
    assert eff["tok_s"]["float32"] > 0 and eff["tok_s"]["bfloat16"] > 0
    assert all(r["lossless"] for r in doc["summary"])  # against the bf16 baseline
    assert doc["numerics"]["dtype"] == "bfloat16" and doc["numerics"]["batch_invariant"]
    assert doc["numerics"]["attention"] == "invariant"
    cost = doc["invariance_cost"]  # the switch's price beside the default path, same run
    assert cost["tok_s"]["batch_invariant"] > 0 and cost["tok_s"]["default"] > 0
    assert cost["ratio_ci"][0] <= cost["ratio"] <= cost["ratio_ci"][1]
    assert cost["default"]["attention"] == "torch" and not cost["default"]["batch_invariant"]
    printed = capsys.readouterr().out
    assert "dtype bfloat16 vs float32 (baselines, same run)" in printed
    assert "batch_invariant cost (bfloat16, plain decode, same run)" in printed
    assert "thread count:" in printed or "threads=" in printed


def test_float32_has_no_dtype_effect(micro_target: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import workbench as wb
    from workbench.bench.spec import dtype_effect

    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    with wb.Engine(micro_target) as e:
        assert dtype_effect(e, [[5, 6, 7]], 4) is None
