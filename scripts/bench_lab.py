"""The lab's ±10 % benchmark: replayed vs measured tok/s ratios (policy / never) on one workload.

1. ``lab record`` the prompts (trees at every position, the step-time model);
2. ``bench concurrency --policy P --prompts-file F --json`` (the policies for real, interleaved
   with baseline and never);
3. ``lab replay RUN --policy P --against`` the bench's rows.

Prints the 9-cell table (replayed vs measured ratio, error, pass/FAIL at ±10 %) with the
machine and the load around every step, and writes ``OUT/lab_validation.json``. The recording
measures its step model the way step 2 runs (every arm on its own engine, interleaved): both
on an idle machine, or the comparison measures the load's drift between them. Usage::

    python scripts/bench_lab.py --prompts-file F.jsonl --out DIR \\
        [--policy always,threshold:auto,goodput] [--levels 1,4,16] [--max-new-tokens 64]
        [--engine threads=2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str], stdout: Path | None = None) -> None:
    print("$ python -m workbench " + " ".join(argv), flush=True)
    with open(stdout, "w") if stdout else open(os.devnull, "w") as out:
        subprocess.run([sys.executable, "-m", "workbench", *argv], cwd=ROOT, check=True,
                       stdout=out if stdout else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts-file", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy", default="always,threshold:auto,goodput")
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--shape", default="5,4,16")
    ap.add_argument("--engine", default="", metavar="KEY=VALUE,...",
                    help="EngineConfig overrides for the recording and the bench alike "
                         "(e.g. threads=2: on a busy machine the engines may choose apart)")
    ns = ap.parse_args()
    engine = ["--engine", ns.engine] if ns.engine else []
    sys.path.insert(0, str(ROOT))
    from workbench.machine import format_machine, loadavg, machine_info

    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    loads = {"start": loadavg()}
    _run(["lab", "record", "--prompts-file", ns.prompts_file, "--shape", ns.shape,
          "--max-new-tokens", str(ns.max_new_tokens), "--out", str(out / "run"), *engine])
    loads["recorded"] = loadavg()
    _run(["bench", "concurrency", "--prompts-file", ns.prompts_file, "--policy", ns.policy,
          "--levels", ns.levels, "--max-new-tokens", str(ns.max_new_tokens), "--spec",
          ns.shape, "--json", "--out", str(out / "bench"), *engine], stdout=out / "bench.jsonl")
    loads["measured"] = loadavg()
    _run(["lab", "replay", str(out / "run"), "--policy", ns.policy, "--levels", ns.levels,
          "--against", str(out / "bench.jsonl"), "--json"], stdout=out / "replay.jsonl")
    rows = [json.loads(line) for line in (out / "replay.jsonl").read_text().splitlines()]
    machine = machine_info()
    print(f"\nmachine: {format_machine(machine)}")
    print("load (1/5/15 min): " + ", ".join(f"{k} {v}" for k, v in loads.items()))
    # the project's rule (workbench.bench.sanity): a 1-min load above the cores means other
    # work shared the run; a quiet machine running this benchmark's own threads reads ≈ cores
    cores = os.cpu_count() or 1
    loaded = max((v[0] for v in loads.values() if v), default=0.0) > cores
    if loaded:
        print(f"  (a loaded machine, load above its {cores} cores: the ratios are provisional; "
              "rerun it idle)")
    print(f"{'policy':>16} {'c':>3} {'replayed':>9} {'measured':>9} {'error':>7}  ±10 %")
    checked = []
    for r in rows:
        if r["policy"] in ("never", "oracle") or r.get("measured_vs_never") is None:
            continue
        checked.append(r)
        print(f"{r['policy']:>16} {r['concurrency']:>3} {r['vs_never']:>9.3f} "
              f"{r['measured_vs_never']:>9.3f} {r['ratio_error']:>+7.1%}  "
              f"{'pass' if r['within_10pct'] else 'FAIL'}")
    ok = sum(1 for r in checked if r["within_10pct"])
    print(f"{ok}/{len(checked)} cells within ±10 %")
    (out / "lab_validation.json").write_text(json.dumps(
        {"machine": machine, "load": loads, "policy": ns.policy, "levels": ns.levels,
         "engine": ns.engine, "cores": cores, "loaded": loaded,
         "max_new_tokens": ns.max_new_tokens, "rows": rows, "within": ok,
         "cells": len(checked)}, indent=2) + "\n")
    print(f"wrote {out / 'lab_validation.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
