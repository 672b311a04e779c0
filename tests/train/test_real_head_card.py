"""The real head's card names where the head trained (CPU threads and load, or the GPU), the
step it exported and the head it started from, from the files the run wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.train.real_head_card import render

ACC = [0.5, 0.4, 0.3, 0.2, 0.1]


def head_folder(tmp: Path, summary: dict[str, Any], run: dict[str, Any]) -> Path:
    base: dict[str, Any] = {
        "steps": 40, "tokens": 1000, "seconds": 120.0, "tokens_per_second": 8.3,
        "parameters": 9.8e6, "torch_threads": 1, "draft_vocab_coverage": 0.98,
        "train": {"acc": ACC}, "heldout": {"acc": ACC}, "greedy_score_temperature": 1.1,
        "est_accept_length_chain": {"heldout": 1.5}, "history": [
            {"step": 20, "loss": 3.0, "acc": ACC, "seconds": 60.0}],
        "config": {"batch": 4, "seq_len": 256, "ttt_steps": 5, "step_decay": 0.8, "lr": 2e-3,
                   "warmup": 20, "eval_every": 0, "init_from": ""}}
    for k, v in summary.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and k in base else v
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "training_summary.json").write_text(json.dumps(base))
    (tmp / "run.json").write_text(json.dumps(run))
    (tmp / "config.json").write_text(json.dumps({"hidden_size": 576, "draft_vocab_size": 8192}))
    return tmp


def test_cpu_card_names_threads_and_load(tmp_path: Path) -> None:
    head = head_folder(tmp_path, {}, {"cpu": "AMD EPYC, 2 cores", "load": "load 2-3"})
    text = render(head, {}, {})
    assert text.startswith("# smollm2-eagle3 — an EAGLE-3 head for SmolLM2-135M-Instruct, "
                           "trained on CPU\n")
    assert "1 torch thread(s) (provisional, under load: load 2-3)" in text
    assert "| machine | AMD EPYC, 2 cores; load load 2-3 |" in text
    assert "| exported |" not in text and "| started from |" not in text


def test_gpu_card_names_the_device_the_exported_step_and_the_start(tmp_path: Path) -> None:
    head = head_folder(
        tmp_path,
        {"device": "cuda:0", "device_name": "NVIDIA H200", "exported_step": 30,
         "selection": [{"step": 30, "acc": ACC, "est_accept_length_chain": 1.6}],
         "config": {"eval_every": 10, "init_from": "runs/first/out"}},
        {"training_machine": "one H200", "load": "shared with one other run"})
    text = render(head, {}, {})
    assert "trained on one NVIDIA H200 GPU\n" in text.splitlines()[0] + "\n"
    assert "tokens/s, on NVIDIA H200 |" in text
    assert ("| exported | step 30 of 40: the best chain estimate on held-out answers, scored "
            "every 10 steps (`--eval-every`) |") in text
    assert "| started from | the head in `runs/first/out` (`--init-from`" in text
    assert "| machine | one H200; load shared with one other run |" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    table = text.split("| | |")[1].split("\n\n")[0]
    assert "\n\n" not in table and all(r.endswith("|") for r in rows)
