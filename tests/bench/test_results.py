"""One results file per machine kind: runs merge into it, the model cards quote it with the
machine, command, load and flags of every figure."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from workbench.bench import results
from workbench.bench.sanity import Flag, report
from workbench.data_io import load_result_files

ROOT = Path(__file__).resolve().parents[2]
MACHINE = {"cpu": "Intel(R) Xeon(R) Platinum 8581C CPU @ 2.10GHz", "kind": None, "cores": 2,
           "flags": ["avx2", "avx512f"], "l2": 2 << 20, "l3": 260 << 20, "torch": "2.13.0+cpu",
           "commit": "abc1234", "torch_threads": 2}


def test_runs_merge_per_machine_kind(tmp_path: Path) -> None:
    rep = report([Flag("loaded", "load 3 > 2 cores")],
                 {"before": [3.0, 2.0, 1.0], "after": [2.5, 2.0, 1.0], "cores": 2}, MACHINE)
    p1 = results.record(tmp_path, "spec", [{"arm": "baseline", "tok_s": 100.0}], rep,
                        command="python -m workbench bench spec")
    p2 = results.record(tmp_path, "peers", [{"arm": "workbench", "tok_s": 120.0}], rep,
                        command="python -m workbench bench peers")
    assert p1 == p2 == tmp_path / "intel-xeon-platinum-8581c.json"
    doc = json.loads(p1.read_text())
    assert set(doc["benchmarks"]) == {"spec", "peers"}
    assert doc["benchmarks"]["spec"]["flags"] == ["loaded"]
    assert doc["benchmarks"]["spec"]["load"]["before"][0] == 3.0
    assert doc["machine"]["l3"] == 260 << 20
    assert list(load_result_files(tmp_path)) == ["intel-xeon-platinum-8581c"]


def test_model_card_section_names_machine_and_command(tmp_path: Path) -> None:
    rep = report([], {"before": [0.5, 0, 0], "after": [0.7, 0, 0], "cores": 2}, MACHINE)
    results.record(tmp_path, "spec", [{"arm": "tree", "speedup": 2.02, "lossless": True}], rep,
                   command="python -m workbench bench spec --prompts 16")
    spec = importlib.util.spec_from_file_location("write_model_cards",
                                                  ROOT / "scripts" / "write_model_cards.py")
    assert spec is not None and spec.loader is not None
    cards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cards)
    text = cards.machine_section(tmp_path)
    assert "### Intel(R) Xeon(R) Platinum 8581C" in text
    assert "`python -m workbench bench spec --prompts 16`" in text
    assert "load 0.5 → 0.7 on 2 cores; flags: none" in text
    assert "| tree | 2.02 | True |" in text
    # the commit stays in the result file the section names, out of the card's prose
    assert "abc1234" not in text and "intel-xeon-platinum-8581c.json`" in text
    card = tmp_path / "README.md"
    card.write_text("# card\n\nbody\n")
    cards.append_machine_section(card, text)
    cards.append_machine_section(card, text)  # idempotent: replaces the section
    assert card.read_text().count(cards.BY_MACHINE) == 1
