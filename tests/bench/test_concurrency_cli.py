"""``bench concurrency``: the threshold arm's n comes from the cost model calibrated on this
machine (``--threshold auto``) or is forced (``--threshold N``); either way the run prints it,
and the auto choice is saved with its reason (``config.policy_basis``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from workbench import data_io
from workbench.__main__ import main
from workbench.models.synthetic import write_random_head


@pytest.fixture
def prompts_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(data_io, "PROMPTS_DIR", tmp_path / "prompts")
    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    data_io.save_prompts([data_io.Prompt("a", "code", "def f(x):\n", "t"),
                            data_io.Prompt("b", "code", "import os\n", "t")],
                           tmp_path / "prompts" / "heldout.jsonl")
    return tmp_path / "prompts"


def test_concurrency_threshold_auto_and_forced(micro_target: Path, tmp_path: Path,
                                               prompts_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    head = write_random_head(micro_target, tmp_path / "head", draft_vocab=100)
    base = ["bench", "concurrency", "--model", str(micro_target), "--draft", str(head),
            "--levels", "1,2", "--max-new-tokens", "4", "--prompts", "2", "--sequential",
            "--spec", "2,2,4", "--engine", "gemm=dense"]
    assert main([*base, "--out", str(tmp_path / "auto")]) == 0
    out = capsys.readouterr().out
    m = re.search(r"threshold arm: BatchThreshold\(n=(\d+)\) from the cost model calibrated "
                  r"now: S2K2N4 at τ ([\d.]+) is predicted (faster|slower) than plain "
                  r"\(cold draft\)", out)
    assert m is not None
    assert "vs the envelope" in out and "threshold_vs_envelope" in out
    doc = json.loads((tmp_path / "auto" / "concurrency.json").read_text())
    basis = doc["config"]["policy_basis"]["threshold"]
    assert basis["n"] == int(m.group(1)) and f"{basis['tau']:.2f}" == m.group(2)
    # never "faster ... up to decode batch 0": a threshold of 0 is slower at every batch
    assert (m.group(3) == "slower") == (basis["n"] == 0)
    assert basis["policy"] == f"BatchThreshold(n={basis['n']})" and basis["reason"] in out
    assert basis["shape"] == [2, 2, 4] and not basis["warm"]

    assert main([*base, "--threshold", "3", "--out", str(tmp_path / "forced")]) == 0
    out = capsys.readouterr().out
    assert "threshold arm: BatchThreshold(n=3) (forced by --threshold)" in out
    doc = json.loads((tmp_path / "forced" / "concurrency.json").read_text())
    assert doc["config"]["policy_basis"] == {}


@pytest.mark.parametrize("value", ["-1", "eight"])
def test_threshold_flag_errors_name_the_flag(value: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "concurrency", "--threshold", value, "--out", str(tmp_path)]
    assert main(argv) == 1
    assert "ConfigError: --threshold: expected 'auto' or an integer >= 0" in \
        capsys.readouterr().err
