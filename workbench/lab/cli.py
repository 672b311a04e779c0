"""``python -m workbench lab {record,replay}``: record one run, replay any policy on it.

* ``lab record --prompts-file F.jsonl --shape S,K,N --max-new-tokens N --out RUN``: greedy
  outputs and every draft tree at every output position (:mod:`workbench.lab.record`), plus
  this machine's step-time model (forward costs from ``calibrate`` at two contexts, whole
  steps of closed loops on the prompts at c = 1, 4, 16, every arm on its own engine and
  interleaved as ``bench concurrency`` runs them: :mod:`workbench.lab.stepfit`) and the
  machine and load;
* ``lab replay RUN --policy P --levels 1,4,16,64 [--json]``: the closed-loop replay
  (:mod:`workbench.lab.replay`); ``--json`` prints one JSON object per (policy, level) with
  at least policy, concurrency, tok_s, tau, spec_fraction, regret; ``--against BENCH.json``
  puts a real ``bench concurrency --json`` run's ratios beside the replayed ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from workbench.errors import ConfigError

DEFAULT_POLICIES = "always,threshold:auto,goodput,sglang,vllm"
CALIBRATION_CONTEXTS = (128, 384)


def add_parser(sub: Any, default_target: str, default_draft: str) -> None:
    lab = sub.add_parser("lab", help="policy lab: record one run, replay any policy on it")
    verbs = lab.add_subparsers(dest="verb", required=True)
    r = verbs.add_parser("record", help="record greedy outputs + every draft tree")
    r.add_argument("--model", default=default_target)
    r.add_argument("--draft", default=default_draft)
    r.add_argument("--prompts-file", required=True, metavar="F.jsonl",
                   help='one {"prompt": ...} per line')
    r.add_argument("--shape", default="5,4,16", metavar="S,K,N",
                   help="the largest shape to replay (every sub-shape replays exactly)")
    r.add_argument("--chain-steps", type=int, default=None,
                   help="record chains this deep (default max(S, 7): SGLang's default tiers)")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--out", required=True, metavar="RUN", help="folder for the recording")
    r.add_argument("--engine", default="", metavar="KEY=VALUE,...",
                   help="EngineConfig overrides (as bench --engine)")
    r.set_defaults(fn=cmd_record)
    p = verbs.add_parser("replay", help="replay policies on a recorded run")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--policy", default=DEFAULT_POLICIES, metavar="P,...",
                   help="never, always, threshold:N|auto, table:LO-HI=S5K4N16|off,..., "
                        "goodput, sglang[:TIERS.json], vllm[:LO-HI=K,...], oracle "
                        "(never and oracle always run: the ratio's base and the bound)")
    p.add_argument("--levels", default="1,4,16,64", metavar="C1,C2,...")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default max(2c, prompts), as bench)")
    p.add_argument("--json", action="store_true", help="one JSON object per policy and level")
    p.add_argument("--against", default=None, metavar="BENCH.json",
                   help="a `bench concurrency --json` output: measured ratios beside")
    p.add_argument("--tiers", default=None, metavar="OUT.json",
                   help="compile the winning policy (least mean regret; or --tiers-policy) to "
                        "an SGLang 0.5.23 adaptive-tier file, checked by SGLang's own router")
    p.add_argument("--tiers-policy", default=None, metavar="P",
                   help="compile this replayed policy instead of the winner (e.g. oracle)")
    p.set_defaults(fn=cmd_replay)
    f = verbs.add_parser("fit-box", help="a replayable run from box measurements")
    f.add_argument("--threshold-json", required=True, metavar="DIR|threshold.json",
                   help="`bench threshold --url BASELINE_URL,EAGLE3_URL --out DIR` output")
    f.add_argument("--records", required=True, metavar="DIR|FILE",
                   help="the EAGLE-3 server's --export-metrics-to-file records")
    f.add_argument("--shape", required=True, metavar="S,K,N",
                   help="the EAGLE-3 server's --speculative-num-steps/eagle-topk/num-draft-tokens")
    f.add_argument("--out", required=True, metavar="BOXRUN")
    f.add_argument("--max-running-requests", type=int, default=48, metavar="N",
                   help="the EAGLE-3 server's --max-running-requests (SGLang's EAGLE default: "
                        "48); the replay runs no more requests at once")
    f.set_defaults(fn=cmd_fit_box)
    b = verbs.add_parser("box", help="a box's step model: fitted constants, predictions with "
                                     "their bands, tok/s per level (docs/LAB.md)")
    b.add_argument("--preset", default="seeds", metavar="NAME|BOX.json",
                   help="a box from data/boxes (seeds, h200-nvlink, cpu) or a JSON file")
    b.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="describe the box before the fit (repeatable), e.g. "
                        "link.paths.nccl.latency_us=9")
    b.add_argument("--what-if", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="change the fitted box after the fit, never refitting (repeatable), "
                        "e.g. server.allreduce_fusion=false")
    b.add_argument("--seeds", default=None, metavar="NUMBERS.json",
                   help="measured numbers to fit (default: data/seeds for --preset seeds)")
    b.add_argument("--tau", type=float, default=None, help="τ (default: the workload's)")
    b.add_argument("--threshold-json", default=None, metavar="DIR|threshold.json",
                   help="fit the box's two constants to this `bench threshold --url` sweep")
    b.add_argument("--records", default=None, metavar="DIR|FILE",
                   help="with --threshold-json: the EAGLE-3 server's records (τ, lengths)")
    b.add_argument("--json", action="store_true", help="the whole report as one JSON object")
    b.set_defaults(fn=cmd_box)
    fc = verbs.add_parser("formcheck", help="the box's step-model form on this CPU: fit the "
                                            "engine's forwards over a grid, predict held-out")
    fc.add_argument("--models", default="data/models/wb-target,data/models/wb-moe",
                    metavar="DIR,...", help="targets to time (dense and MoE)")
    fc.add_argument("--repeats", type=int, default=7, help="runs per point (the minimum)")
    fc.add_argument("--grid", default="1,2,4,8;1,4;32,128,384", metavar="R...;Q...;C...",
                    help="requests; new tokens per request; context tokens")
    fc.add_argument("--threads", type=int, default=None, help="engine threads")
    fc.add_argument("--out", default=None, metavar="FILE.json",
                    help="result file (default data/results/formcheck-<machine kind>.json)")
    fc.set_defaults(fn=cmd_formcheck)


def shape_arg(text: str, flag: str) -> tuple[int, int, int]:
    from workbench.policy.policies import check_shape

    try:
        s, k, n = (int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"{flag}: expected three integers S,K,N, got {text!r}") from None
    return check_shape((s, k, n), flag)


def levels_arg(text: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--levels: expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"--levels: concurrency levels must be >= 1, got {text!r}")
    return out


def cmd_record(ns: argparse.Namespace) -> int:
    from pathlib import Path

    import workbench as wb
    from workbench.config import engine_config
    from workbench.data_io import read_prompts_file
    from workbench.lab.record import record
    from workbench.lab.stepfit import BATCHES, anchor_shapes, fit_step_model
    from workbench.lab.trees import bs1_accept_lengths
    from workbench.machine import loadavg, machine_info

    shape = shape_arg(ns.shape, "--shape")
    prompts = read_prompts_file(ns.prompts_file)
    for flag, path in (("--model", ns.model), ("--draft", ns.draft)):
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{flag}: no model at {path}")
    before = loadavg()
    # the draft in its own dtype: replay needs its scores exact (lab/record.py)
    engine = wb.Engine.from_pretrained(ns.model, draft=ns.draft,
                                       config=engine_config(ns, draft_dtype="same"))
    extra: list[Any] = []
    try:
        # one engine per measured arm (baseline, never, the anchor shapes), as bench runs them
        longest = max(len(engine.tokenize(p)) for p in prompts)
        need = max(BATCHES) * (longest + ns.max_new_tokens + 2 * engine.config.page_size + 64)
        for _ in range(1 + len(anchor_shapes(shape))):
            extra.append(wb.Engine.from_pretrained(ns.model, draft=ns.draft, config=engine_config(
                ns, kv_budget_tokens=need)))
        cm = fit_step_model(engine, prompts, shape, contexts=CALIBRATION_CONTEXTS,
                            tokens=ns.max_new_tokens, engines=extra)
        for e in extra:
            e.close()
        extra = []
        run = record(engine, prompts, shape, ns.max_new_tokens, ns.chain_steps, cm,
                     progress=sys.stderr.isatty())
    finally:
        engine.close()
        for e in extra:
            e.close()
    run.meta.update({"model": str(ns.model), "draft": str(ns.draft),
                     "prompts_file": str(ns.prompts_file), "machine": machine_info(),
                     "load_before": before, "load_after": loadavg(),
                     "calibration_contexts": list(CALIBRATION_CONTEXTS)})
    out = run.save(ns.out)
    lens = [e for r in bs1_accept_lengths(run, shape) for e in r]
    print(f"recorded {len(prompts)} prompts x {ns.max_new_tokens} tokens: {len(run.req)} "
          f"positions, top-k 1..{shape[1]} (chains to {run.chain_steps} steps) in "
          f"{run.meta['record_s']:.1f} s; bs=1 τ at S{shape[0]}K{shape[1]}N{shape[2]}: "
          f"{sum(lens) / max(1, len(lens)):.2f}; load {before} → {run.meta['load_after']}")
    print(f"saved {out}")
    return 0


def cmd_replay(ns: argparse.Namespace) -> int:
    import pandas as pd

    from workbench.lab.replay import json_rows, load_run, replay

    levels = levels_arg(ns.levels)
    if ns.requests is not None and ns.requests < 1:
        raise ConfigError(f"--requests: must be >= 1, got {ns.requests}")
    run = load_run(ns.run)
    df, results = replay(run, ns.policy, levels, num_requests=ns.requests)
    if ns.tiers:
        with contextlib.redirect_stdout(sys.stderr if ns.json else sys.stdout):
            tiers_out(df, results, ns.tiers, ns.tiers_policy)
    sign = None
    if ns.against:
        from workbench.lab.validate import against, sign_test, sign_text

        df = against(df, ns.against)
        sign = sign_test(df)
    if ns.json:
        for row in json_rows(df):
            print(json.dumps(row))
        return 0
    cols = [c for c in ("policy", "concurrency", "tok_s", "vs_never", "measured_vs_never",
                        "measured_n", "ratio_error", "error_lo", "error_hi", "within_10pct",
                        "tau", "spec_fraction", "tpot_n", "tpot_p50_ms", "tpot_p99_ms",
                        "regret") if c in df]
    with pd.option_context("display.width", 240, "display.max_columns", 24):
        print(df[cols].round(3).to_string(index=False))
    from workbench.viz.figures.style import MIN_P99_SAMPLES

    print(f"tpot_p99_ms: none from fewer than {MIN_P99_SAMPLES} requests (tpot_n)")
    if sign is not None:
        print(f"replayed vs measured: {sign_text(sign)}")
    for note in getattr(run, "notes", []):
        print(f"modelled: {note}")
    for c, g in df.groupby("concurrency"):
        first = g.iloc[0]
        if bool(first.get("capped", False)):
            print(f"c={c}: above the server's running-request cap {first['batch_cap']}: run "
                  f"as the server runs it ({first['batch_cap']} at once, the rest queue)")
        if first.get("bound", "oracle") != "oracle":
            print(f"c={c}: {first['bound_note']}")
    acc = df.attrs["acceptance"]
    print(f"\nτ measured on the recording (first 8 prompts, always): {acc['tau']:.2f}; step "
          f"times modelled from the run's cost model; machine of the recording: "
          f"{run.meta.get('machine', {}).get('cpu')}")
    for name, basis in df.dropna(subset=["basis"]).groupby("policy")["basis"].first().items():
        print(f"{name}: {basis}")
    return 0


def tiers_out(df: Any, results: dict[Any, Any], path: str, name: str | None) -> None:
    """Compile a replayed policy's decisions to a tier file at ``path``, check it with SGLang."""
    from workbench.lab.boxreplay import check_tiers, compile_tiers, initial_steps
    from workbench.lab.replay import winner

    pick = name or winner(df)
    steps = [st for (p, _), res in results.items() if p == pick for st in res.steps]
    if not steps and pick not in set(df["policy"]):
        raise ConfigError(f"--tiers-policy {pick}: not among the replayed policies "
                          f"{sorted(set(df['policy']))}")
    top = max(int(c) for c in df["concurrency"])
    tiers, notes = compile_tiers(steps, top)
    check_tiers(tiers, path, top)
    print(f"\ntier file for SGLang 0.5.23 ({pick}; routed by SGLang's own "
          f"AdaptiveSpeculativeParams at batch 1..{top}: same tiers): {path}")
    print(tiers.config_text(), end="")
    print(f"launch with --speculative-adaptive --speculative-adaptive-config {path} "
          f"--speculative-num-steps {initial_steps(tiers)} --speculative-eagle-topk 1 "
          f"--speculative-num-draft-tokens {initial_steps(tiers) + 1}")
    for note in notes:
        print(f"note: {note}")


def cmd_fit_box(ns: argparse.Namespace) -> int:
    from workbench.lab.boxreplay import fit_box
    from workbench.remote.records import iter_records, read_request_metrics

    shape = shape_arg(ns.shape, "--shape")
    hist = any(rec.get("spec_correct_drafts_histogram") for _, rec in iter_records(ns.records))
    run = fit_box(ns.threshold_json, read_request_metrics(ns.records), shape,
                  max_running_requests=ns.max_running_requests, histogram=hist)
    out = run.save(ns.out)
    cm = run.cost_model
    print(f"box run: {len(run.output_lens)} requests, per-depth acceptance "
          f"{[round(a, 3) for a in run.rates]} (τ {run.meta['tau']:.2f}; from "
          f"{run.meta['acceptance']}); target ms = {cm['target']['a']:.2f} + "
          f"{cm['target']['b']:.4f}·tokens, draft ms = {cm['draft']['a']:.2f} + "
          f"{cm['draft']['b']:.4f}·tokens")
    for note in run.notes:
        print(f"modelled: {note}")
    print(f"saved {out}; replay with `python -m workbench lab replay {out} --policy ...`")
    return 0


def cmd_box(ns: argparse.Namespace) -> int:
    from workbench.lab.boxreport import box_report, print_report

    records = None
    if ns.records:
        from workbench.remote.records import read_request_metrics

        records = read_request_metrics(ns.records)
    rep = box_report(ns.preset, ns.set, ns.seeds, ns.tau, threshold=ns.threshold_json,
                     records=records, what_ifs=ns.what_if)
    if ns.json:
        rep = {k: v for k, v in rep.items() if k != "fitted_box"}
        print(json.dumps(rep, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
        return 0
    print_report(rep)
    return 0


def cmd_formcheck(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from workbench.lab.boxspec import REPO_ROOT
    from workbench.lab.formcheck import formcheck
    from workbench.machine import machine_kind

    try:
        grid = tuple([int(x) for x in part.split(",")] for part in ns.grid.split(";"))
        if len(grid) != 3 or min(min(g) for g in grid) < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--grid: expected R,...;Q,...;C,... of integers >= 1, got "
                          f"{ns.grid!r}") from None
    if ns.repeats < 1:
        raise ConfigError(f"--repeats: must be >= 1, got {ns.repeats}")
    res = formcheck([m for m in ns.models.split(",") if m], ns.repeats, grid,  # type: ignore[arg-type]
                    ns.threads)
    out = Path(ns.out) if ns.out else \
        REPO_ROOT / "data" / "results" / f"formcheck-{machine_kind()}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    for m, v in res["models"].items():
        errs = ", ".join(f"{r['error']:+.1%}" for r in v["held_out"])
        print(f"{m}: held-out errors {errs} (max {v['max_held_out_error']:.1%}, mean "
              f"{v['mean_held_out_error']:.1%}; fit max {v['max_fit_error']:.1%}): "
              f"{'within' if v['within'] else 'NOT within'} ±{res['tolerance']:.0%}; the KV "
              f"read at the weights' rate fits every point to {v['tied_kv_max_fit_error']:.1%}")
        if v["outside"]:
            errs = ", ".join(f"{r['error']:+.1%}" for r in v["outside"])
            print(f"  outside the form (one-token MoE path, not fitted): errors {errs}")
    print(f"machine {res['machine'].get('cpu')}; load {res['load_before']} → "
          f"{res['load_after']} (figures under load are provisional); saved {out}")
    return 0
