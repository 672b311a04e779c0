"""The MoE pair's model cards are rendered from data: the shipped folders' config and training
summary, and saved bench results — every figure beside its command, machine and load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from workbench.bench import results
from workbench.bench.sanity import Flag, report
from workbench.train.moe_card import moe_draft_card, moe_target_card, write_moe_cards

ROOT = Path(__file__).resolve().parents[2]
MACHINE = {"cpu": "AMD EPYC", "family": 26, "kind": "amd-epyc-family-26", "cores": 2,
           "flags": ["avx2"], "l2": 1 << 20, "l3": 32 << 20, "torch": "2.13.0+cpu",
           "commit": "abc1234", "torch_threads": 1, "time": "2026-12-01 18:00:00"}
COMMANDS = {"train": "upcycle ...", "train_machine": "on the test machine", "peers": "PEERS",
            "spec_moe": "SPEC-MOE", "spec_dense": "SPEC-DENSE", "ratio": "RATIO"}


def _spec_doc(tau: float, load: float) -> dict:
    return {"machine": MACHINE, "load": {"before": [load, 0, 0], "after": [load, 0, 0],
                                         "cores": 2},
            "flags": [{"code": "loaded", "message": "x"}] if load > 2 else [],
            "summary": [{"arm": "baseline", "tok_s": 30.0, "speedup": 1.0, "tau": 1.0,
                         "verify_ratio": None, "lossless": True},
                        {"arm": "chain S5", "tok_s": 45.0, "speedup": 1.5, "tau": tau,
                         "verify_ratio": 1.7, "lossless": True}]}


def test_moe_cards_render_from_data(tmp_path: Path) -> None:
    res = tmp_path / "results"
    (res / "dense").mkdir(parents=True)
    (res / "spec_bs1.json").write_text(json.dumps(_spec_doc(2.71, 3.5)))
    (res / "dense" / "spec_bs1.json").write_text(json.dumps(_spec_doc(3.33, 1.0)))
    (res / "peers.json").write_text(json.dumps({
        "machine": MACHINE, "load": {"before": [1.1, 0, 0], "after": [1.3, 0, 0], "cores": 2},
        "flags": [], "summary": [{"arm": "hf generate", "tok_s": 20.0, "vs_hf_generate": 1.0,
                                  "same_as_hf": True},
                                 {"arm": "workbench", "tok_s": 33.0, "vs_hf_generate": 1.65,
                                  "same_as_hf": True}]}))
    rep = report([Flag("loaded", "load 3 > 2 cores")],
                 {"before": [3.0, 2, 1], "after": [3.2, 2, 1], "cores": 2}, MACHINE)
    results.record(res, "cost_ratio", [{"target": "wb-moe", "batch": 4, "decode_ms": 10.0,
                                        "verify_ms": 15.0, "ratio": 1.5, "predicted": 1.55,
                                        "error": 0.033, "within": True}], rep, command="RATIO")
    target = ROOT / "data/models/wb-moe"
    text = moe_target_card(target, res, COMMANDS)
    summary = json.loads((target / "training_summary.json").read_text())
    assert text.startswith("# wb-moe — wb-target sparsely upcycled into 8 experts, top-2")
    assert f"{summary['heldout_loss']:.2f}" in text and "on the test machine" in text
    assert "| workbench | 33.0 | 1.65 | True |" in text and "Command: `PEERS`" in text
    assert "load 1.1 → 1.3 on 2 cores." in text
    assert "| chain S5 | 45.0 | 1.50 | 2.71 | 1.70 | True |" in text
    assert "| chain S5 | 45.0 | 1.50 | 3.33 | 1.70 | True |" in text  # the dense pair beside
    assert "load 3.5 → 3.5 on 2 cores; flags: loaded" in text  # a loaded run says so
    assert "| wb-moe | 4 | 10.00 | 15.00 | 1.50 | 1.55 | 0.033 | True |" in text
    assert "Command: `RATIO`" in text
    draft = moe_draft_card(ROOT / "data/models/wb-moe-eagle3", res, COMMANDS)
    assert draft.startswith("# wb-moe-eagle3") and "SPEC-MOE" in draft and "SPEC-DENSE" in draft
    # nothing measured yet: the sections say so instead of inventing figures
    empty = moe_target_card(target, tmp_path / "none", COMMANDS)
    assert empty.count("_not measured yet_") == 4
    # write_moe_cards writes both READMEs
    t, d = tmp_path / "wb-moe", tmp_path / "wb-moe-eagle3"
    shutil.copytree(target, t, ignore=shutil.ignore_patterns("*.safetensors", "tokenizer*"))
    shutil.copytree(ROOT / "data/models/wb-moe-eagle3", d,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    write_moe_cards(t, d, res, {"moe": COMMANDS, "moe_draft": COMMANDS})
    assert (t / "README.md").read_text() == text
    assert (d / "README.md").read_text() == draft
