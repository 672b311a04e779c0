"""The verify/decode cost ratio at B = 1, 4, 16: measured vs the cost model's prediction, for
the shipped MoE target beside the dense one (issue 30's goal: within ±15 %).

Usage (from the repository root; quiet machine for figures worth committing):

    OMP_NUM_THREADS=1 python scripts/bench_moe_ratio.py                 # wb-moe and wb-target
    python scripts/bench_moe_ratio.py --model data/models/wb-moe --repeats 9 --strict

Prints, per target, the fitted terms and the table (decode ms, verify ms, measured ratio,
predicted ratio, error, pass/fail), with the machine and the load before and after; records
the rows in ``data/results/wb-moe/<machine kind>.json`` under ``cost_ratio`` (``--out``). Exit
status 1 when some ratio is off by more than the tolerance, 2 with ``--strict`` when the load
exceeded the cores (the figures are then provisional). Method: ``workbench.bench.cost_ratio``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
PAIRS = {"data/models/wb-moe": "data/models/wb-moe-eagle3",
         "data/models/wb-target": "data/models/wb-eagle3"}


def main(argv: list[str] | None = None) -> int:
    import workbench as wb
    from workbench.bench.cost_ratio import TOLERANCE, cost_ratios, model_terms
    from workbench.bench.results import record
    from workbench.bench.sanity import LoadSampler, report, sanity_flags
    from workbench.machine import format_machine, machine_info

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=None,
                   help="target folder (repeatable; default: wb-moe and wb-target)")
    p.add_argument("--draft", default=None, help="its EAGLE-3 head (default: the shipped one; "
                   "'none' for none): the verify forward then also taps aux hidden states")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--out", default="data/results/wb-moe",
                   help="results folder (the MoE pair's; its model cards read it)")
    p.add_argument("--no-record", action="store_true", help="print only")
    p.add_argument("--strict", action="store_true")
    ns = p.parse_args(argv)
    batches = [int(x) for x in ns.batches.split(",") if x.strip()]
    models = ns.model or list(PAIRS)
    info = machine_info()
    print(f"machine: {format_machine(info)}; torch threads {info['torch_threads']}")
    rows, terms = [], {}
    cfg = wb.EngineConfig(kv_budget_tokens=8192, max_batch_size=max(batches))
    with LoadSampler() as load:
        for path in models:
            draft = ns.draft if ns.draft is not None else PAIRS.get(path.rstrip("/"))
            engine = wb.Engine.from_pretrained(
                path, draft=None if draft in (None, "none") else draft, config=cfg)
            try:
                r, model = cost_ratios(engine, Path(path).name, batches, ns.num_draft_tokens,
                                       ns.context, ns.repeats, tolerance=ns.tolerance)
            finally:
                engine.close()
            rows += r
            terms[Path(path).name] = model_terms(model)
    df = pd.DataFrame(rows)
    for name, t in terms.items():
        print(f"{name}: fitted " + ", ".join(f"{k} {v:.4g}" for k, v in t.items()))
    df["pass"] = df["within"].map({True: "pass", False: "FAIL"})
    print(f"\nverify ({ns.num_draft_tokens} tokens/request) ÷ decode forward, context "
          f"{ns.context}, least of {ns.repeats}; tolerance ±{ns.tolerance:.0%}")
    print(df.drop(columns=["within", "num_draft_tokens", "context"]).to_string(
        index=False, float_format=lambda x: f"{x:.3f}"))
    ld = load.as_dict()
    flags = sanity_flags([], load=ld)
    print(f"load (1/5/15 min) {ld['before']} before, {ld['after']} after, on {ld['cores']} "
          f"cores" + ("; load > cores: figures provisional" if flags else ""))
    if not ns.no_record:
        path = record(ns.out, "cost_ratio", df.drop(columns=["pass"]).to_dict("records"),
                      report(flags, ld, info), shlex.join(
                          ["python", "scripts/bench_moe_ratio.py",
                           *(sys.argv[1:] if argv is None else argv)]),
                      {"terms": terms, "tolerance": ns.tolerance})
        print(f"recorded: {path}")
    if not df["within"].all():
        return 1
    return 2 if ns.strict and flags else 0


if __name__ == "__main__":
    raise SystemExit(main())
