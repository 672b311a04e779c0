"""README.md's and docs/PERFORMANCE.md's speed tables are what scripts/readme_table.py writes
from data/results/ (a figure changes in the pages only through a result file)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_table", ROOT / "scripts" / "readme_table.py")
assert _spec is not None and _spec.loader is not None
readme_table = importlib.util.module_from_spec(_spec)
sys.modules["readme_table"] = readme_table  # dataclasses look their module up there
_spec.loader.exec_module(readme_table)


@pytest.mark.parametrize("page", readme_table.PAGES, ids=lambda p: p.name)
def test_the_page_table_is_what_the_script_writes(page: Path) -> None:
    have, want = readme_table.block(page), readme_table.expected_block(page)
    assert have == want, (f"{page.relative_to(ROOT)}: the speed table differs from "
                          "data/results/; run `python scripts/readme_table.py --write`")


def test_every_cell_links_an_existing_result_file() -> None:
    for page in readme_table.PAGES:
        base = page.parent
        for line in readme_table.block(page).splitlines():
            for part in line.split("](")[1:]:
                target = (base / part.split(")")[0]).resolve()
                assert target.is_file(), f"{page.name}: {target} does not exist"


def test_a_cell_reads_value_interval_date_and_link(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A new machine kind adds a column; a figure with no interval says so; a flagged run
    says so; a figure the kind did not record reads a dash."""
    (tmp_path / "data" / "results").mkdir(parents=True)
    row = {"arm": "workbench", "vs_hf_generate": 1.5, "vs_hf_generate_lo": 1.25,
           "vs_hf_generate_hi": 1.75}
    result = {"machine": {"cpu": "Some CPU (x)", "kind": "some-cpu", "cores": 4},
              "benchmarks": {"peers": {"time": "2026-01-02 03:04:05", "flags": ["busy"],
                                       "summary": [row]}}}
    (tmp_path / "data" / "results" / "some-cpu.json").write_text(json.dumps(result))
    monkeypatch.setattr(readme_table, "ROOT", tmp_path)
    monkeypatch.setattr(readme_table, "RESULTS", tmp_path / "data" / "results")
    lines = readme_table.table().splitlines()
    assert lines[0] == "| figure | Some CPU, 4 cores (`some-cpu`) | command |"
    assert lines[2].split(" | ")[1] == ("**1.50×** (1.25–1.75), 2026-01-02, flagged: busy, "
                                        "[result](data/results/some-cpu.json)")
    assert len(lines) == 3  # rows no kind recorded are left out
    result["machine"]["kind"] = "other"
    (tmp_path / "data" / "results" / "some-cpu.json").write_text(json.dumps(result))
    with pytest.raises(ValueError, match="machine.kind is 'other'"):
        readme_table.table()


def test_a_kind_with_no_headline_figure_adds_no_column(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "data" / "results"
    (results / "other-run").mkdir(parents=True)
    row = {"arm": "workbench", "vs_hf_generate": 1.5}
    for folder, kind, bench in (("", "kind-a", "peers"), ("other-run", "kind-b", "peers")):
        doc = {"machine": {"cpu": kind, "kind": kind, "cores": 2},
               "benchmarks": {bench: {"time": "2026-01-02 03:04:05", "summary": [row]}}}
        (results / folder / f"{kind}.json").write_text(json.dumps(doc))
    monkeypatch.setattr(readme_table, "ROOT", tmp_path)
    monkeypatch.setattr(readme_table, "RESULTS", results)
    head = readme_table.table().splitlines()[0]
    assert "kind-a" in head and "kind-b" not in head  # no headline row reads other-run/
