"""``bench concurrency --prompts-file F --policy P --json``: the named policies for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.__main__ import main
from workbench.models.synthetic import write_random_head


def test_bench_policies_json(micro_target: Path, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    head = write_random_head(micro_target, tmp_path / "head", draft_vocab=100)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n"}\n\n{"prompt": "import os\\n", "id": 2}\n')
    argv = ["bench", "concurrency", "--model", str(micro_target), "--draft", str(head),
            "--levels", "1,2", "--max-new-tokens", "4", "--prompts-file", str(prompts),
            "--sequential", "--spec", "2,2,4", "--engine", "gemm=dense",
            "--policy", "always,threshold:auto,sglang,vllm:1-1=2,2-=0,table:1-=S2K1N3",
            "--json", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    out = capsys.readouterr()
    rows = [json.loads(line) for line in out.out.splitlines()]
    arms = ["baseline", "never", "always", "threshold:auto", "sglang", "vllm:1-1=2,2-=0",
            "table:1-=S2K1N3"]
    assert [(r["policy"], r["concurrency"]) for r in rows] == \
        [(a, c) for c in (1, 2) for a in arms]
    assert all(r["lossless"] for r in rows)  # every policy's outputs equal the baseline's
    by = {(r["policy"], r["concurrency"]): r for r in rows}
    assert by[("vllm:1-1=2,2-=0", 2)]["spec_share"] == 0.0  # off above batch 1
    assert by[("never", 1)]["vs_never"] == 1.0
    assert "threshold:auto arm: BatchThreshold(n=" in out.err  # the basis, on stderr


@pytest.mark.parametrize(("extra", "message"), [
    (["--policy", "oracle"], "oracle: the hindsight oracle exists only in a replay"),
    (["--policy", "always,fast"], "unknown policy 'fast'"),
    (["--json"], "--policy/--json"),
    (["--policy", "always", "--prompts-file", "/nonexistent.jsonl"], "--prompts-file: no file"),
])
def test_bench_policy_errors(extra: list[str], message: str, micro_target: Path,
                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    head = write_random_head(micro_target, tmp_path / "head", draft_vocab=100)
    argv = ["bench", "concurrency", "--model", str(micro_target), "--draft", str(head),
            "--levels", "1", "--out", str(tmp_path), *extra]
    assert main(argv) == 1
    assert message in capsys.readouterr().err
