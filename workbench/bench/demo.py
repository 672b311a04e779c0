"""``make demo``: EAGLE-3 vs baseline on the shipped models, printed as a table.

Also writes ``reports/quickstart.html`` (the executed quickstart notebook) when the notebook
tooling is installed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import workbench as wb
from workbench.bench.cli_output import announce_conditions
from workbench.bench.spec import run_spec_bench
from workbench.data_io import DATA_DIR, REPO_ROOT, load_prompts
from workbench.engine.autotune import provisional_names


def run(ns: argparse.Namespace) -> int:
    conditions = announce_conditions()  # the first line: is this machine busy?
    target, draft = Path(ns.model), Path(ns.draft)
    if not (target / "config.json").is_file():
        raise SystemExit(f"demo: no shipped target at {target} (train one with "
                         "`python -m workbench train-target`)")
    has_draft = (draft / "config.json").is_file()
    engine = wb.Engine.from_pretrained(target, draft=draft if has_draft else None,
                                       config=wb.EngineConfig(device="cpu", dtype="float32"))
    prompts = [p.prompt for p in load_prompts(kinds=("code", "docstring"), limit=ns.prompts)]
    print(f"target {target} · draft {draft if has_draft else '(none)'} · {len(prompts)} held-out "
          f"prompts · {ns.max_new_tokens} new tokens · greedy · bs=1")
    first = engine.generate([prompts[0]], wb.SamplingParams(max_new_tokens=48),
                            spec=wb.SpecConfig() if has_draft else None)[0]
    print("\n--- sample (EAGLE-3) ---\n" + prompts[0][-200:] + first.text + "\n---\n")
    arms: dict[str, wb.SpecConfig | None] | None = None
    if not has_draft:
        arms = {"baseline": None}
    res = run_spec_bench(engine, prompts, arms=arms, max_new_tokens=ns.max_new_tokens)
    print(res.summary.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    busy = provisional_names(engine.choices)
    if conditions.get("contended") or busy:
        print("\nnote: measured on a busy machine (other processes shared the CPU"
              + (f"; provisional choices: {', '.join(busy)}" if busy else "") + "): these "
              "figures are provisional and may understate the speedup; rerun on a quiet "
              "machine (`python -m workbench bench load` measures speed beside a competing "
              "process, docs/PERFORMANCE.md)")
    path = res.save(DATA_DIR / "results", "demo")
    print(f"\nresults: {path}")
    engine.close()
    exporter = REPO_ROOT / "scripts" / "export_reports.py"
    if exporter.is_file():
        subprocess.run([sys.executable, str(exporter), "--fast",
                        str(REPO_ROOT / "notebooks" / "01_quickstart.ipynb")], check=True)
        page = REPO_ROOT / "reports" / "quickstart.html"
        shutil.copyfile(REPO_ROOT / "reports" / "01_quickstart.html", page)
        print(f"report: {page}")
    return 0 if res.summary["lossless"].all() else 1
