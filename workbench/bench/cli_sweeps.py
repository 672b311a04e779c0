"""``python -m workbench bench {concurrency,threshold,k0}``: closed-loop sweeps over concurrency.

* concurrency: the policy arms of ``workbench.bench.concurrency.default_arms`` side by side,
  or a running server level by level with ``--url`` (``workbench.bench.http``); the threshold
  arm's n is the crossover the cost model predicts on this machine (``--threshold auto``, the
  default) or forced (``--threshold N``), printed and saved with its reason;
* threshold: baseline vs eagle3 → the measured crossover and a suggested BatchThreshold(n)
  (``--url BASELINE_URL,EAGLE3_URL``: on the box, ``workbench.remote.crossover``);
* k0: the K=0 tax of the default SpecConfig (BatchThreshold(0) vs baseline, interleaved).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from workbench.bench import cli_args as args
from workbench.bench import http
from workbench.bench.cli_output import finish, json_records, saved_flags, show, stamp
from workbench.bench.cli_policy import bench_policies
from workbench.bench.concurrency import (
    default_arms,
    find_threshold,
    policy_bases,
    summarize,
    switch_costs,
)
from workbench.bench.sanity import LoadSampler, mark, sanity_flags
from workbench.bench.threshold import sweep_threshold
from workbench.config import SpecConfig
from workbench.errors import ConfigError
from workbench.machine import loadavg, machine_info
from workbench.policy.policies import BatchThreshold

if TYPE_CHECKING:
    from workbench.engine.engine import Engine


def _concurrency_arms(engine: Engine, ns: argparse.Namespace, shape: Any,
                      prompts: list[str]) -> dict[str, Any]:
    """``default_arms`` with ``--threshold``; prints the threshold arm's n and why."""
    arms = default_arms(engine, spec=shape, flips=True, threshold=args.threshold(ns),
                        prompts=prompts, max_new_tokens=args.max_new(ns))
    bases = policy_bases(arms)
    for arm, basis in bases.items():
        print(f"{arm} arm: {basis['policy']} from the cost model calibrated now: "
              f"{basis['reason']}")
    forced = arms.get("threshold")
    if forced is not None and "threshold" not in bases:
        print(f"threshold arm: {forced.policy!r} (forced by --threshold)")
    return arms


def bench_concurrency(ns: argparse.Namespace) -> int:
    levels = args.levels(ns)  # flag errors first, whichever path
    args.threshold(ns)
    if getattr(ns, "policy", None) or getattr(ns, "json", False):
        if ns.url or not ns.policy:
            raise ConfigError("--policy/--json: named policies run on a local engine; give "
                              "--policy P,... and no --url")
        return bench_policies(ns)
    if ns.url:
        return bench_http(ns)

    shape = args.spec(ns)
    prompts = args.prompts(ns)
    df, choices = args.sweep(ns, prompts, levels,
                             lambda engine: _concurrency_arms(engine, ns, shape, prompts),
                             need_draft=False, name="concurrency")
    cols = ["arm", "concurrency", "tok_s", "tok_s_lo", "tok_s_hi", "vs_baseline",
            "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
            "itl_p99_ms", "tau", "spec_share", "lossless", "flags"]
    flags = saved_flags(df)
    s = summarize(df)
    show("closed-loop concurrency sweep (greedy)", s[[c for c in cols if c in s]])
    never = s[s["arm"] == "never"]
    if not never.empty:
        show("K=0 tax (never vs baseline): whole-run tok/s and per steady-state step",
             never[["concurrency", "k0_tax", "k0_tax_step"]])
    sc = switch_costs(df)
    if not sc.empty:
        show("cost per switch: warm vs cold draft (RandomFlip p=0.5)", sc)
    env = envelope(s)
    if not env.empty:
        show("vs the envelope (max of baseline and eagle3 per level)", env)
    if {"baseline", "eagle3"} <= set(s["arm"]):
        th = find_threshold(df)
        print(f"\ncrossover: {th.crossover} · suggested BatchThreshold({th.suggested_n})")
    for arm, basis in df.attrs["config"].get("policy_basis", {}).items():
        print(f"{arm} arm: {basis['policy']}: {basis['reason']}")
    _stamp_sweep(df, flags, choices, "concurrency",
                 s[[c for c in [*cols, "k0_tax", "k0_tax_step"] if c in s]])
    lossless = s["lossless"].dropna()
    return finish(ns, bool(lossless.all()), flags)


def envelope(s: pd.DataFrame) -> pd.DataFrame:
    """Per level: the envelope (max tok/s of baseline and eagle3, what a perfect per-level
    on/off choice would get) and every policy arm's tok/s over it (empty without both)."""
    t = s.pivot(index="concurrency", columns="arm", values="tok_s")
    if not {"baseline", "eagle3"} <= set(t.columns):
        return pd.DataFrame()
    out = pd.DataFrame({"envelope": t[["baseline", "eagle3"]].max(axis=1)})
    for arm in ("threshold", "goodput"):
        if arm in t:
            out[f"{arm}_vs_envelope"] = t[arm] / out["envelope"]
    return out.reset_index()


def _stamp_sweep(df: pd.DataFrame, flags: list[Any], choices: dict[str, Any], bench: str,
                 summary: pd.DataFrame, extra: dict[str, Any] | None = None) -> None:
    """Stamp a saved sweep (``df.attrs["saved"]``) and say where it is."""
    stamp(Path(df.attrs["saved"]), flags, df.attrs.get("load"),
          {"engine_choices": choices, **(extra or {})}, bench, summary)
    print(f"\nresults: {df.attrs.get('saved')}")


def bench_http(ns: argparse.Namespace) -> int:
    """Closed-loop sweep against a running server (ours or SGLang), one level at a time."""
    prompts = args.prompts(ns)
    rows = []
    with LoadSampler() as load:
        for c in args.levels(ns):
            n = max(2 * c, len(prompts))
            plist = [prompts[i % len(prompts)] for i in range(n)]
            before = loadavg()
            res = http.run_http_bench(ns.url, plist, concurrency=c,
                                      max_new_tokens=args.max_new(ns))
            after = loadavg()
            print(http.format_table(res))
            rows.append({k: v for k, v in res.items() if k != "requests"}
                        | {"load_before": before[0] if before else None,
                           "load_after": after[0] if after else None})
    df = pd.DataFrame(rows)
    # the server may run on another machine: only the client-side load is known here
    view = df.rename(columns={"output_throughput": "tok_s", "p50_itl_ms": "itl_p50_ms",
                              "accept_length": "tau"})
    flags = sanity_flags(view[[c for c in ("concurrency", "tok_s", "itl_p50_ms", "tau",
                                           "load_before", "load_after") if c in view]],
                         load=load.as_dict())
    df = mark(df, flags)
    cols = ["concurrency", "completed", "failed", "output_throughput", "p50_ttft_ms",
            "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms",
            "accept_length"]
    show(f"HTTP closed-loop sweep against {ns.url}", df[[c for c in cols if c in df]])
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    df.drop(columns=["errors"], errors="ignore").to_csv(out / "concurrency_http.csv", index=False)
    rows_json = json_records(df)
    (out / "concurrency_http.json").write_text(json.dumps(
        {"machine": machine_info(), "url": ns.url, "rows": rows_json}, indent=2) + "\n")
    stamp(out / "concurrency_http.json", flags, load.as_dict(), None, "concurrency_http",
          df.drop(columns=["errors"], errors="ignore"))
    print(f"\nresults: {out / 'concurrency_http.json'}")
    return finish(ns, int(df["failed"].sum()) == 0, flags)


def bench_threshold(ns: argparse.Namespace) -> int:
    if ns.url:  # on the box: --url BASELINE_URL,EAGLE3_URL (workbench.bench.threshold)

        sweep_threshold(ns.url, args.prompts(ns), args.levels(ns), args.max_new(ns), ns.out)
        return 0

    levels = args.levels(ns)
    shape = args.spec(ns)
    prompts = args.prompts(ns)
    df, choices = args.sweep(ns, prompts, levels,
                             lambda _: {"baseline": None, "eagle3": shape},
                             need_draft=True, name="threshold")
    flags = saved_flags(df)
    th = find_threshold(df)
    show("baseline vs eagle3 output tok/s by concurrency", th.table)
    where = "never (eagle3 wins at every level)" if th.crossover is None else \
        f"at concurrency {th.crossover}"
    print(f"\nbaseline catches up {where}; suggested BatchThreshold({th.suggested_n})")
    stamp(Path(df.attrs["saved"]), flags, df.attrs.get("load"), {"engine_choices": choices},
          "threshold", th.table)
    print(f"results: {df.attrs.get('saved')}")
    return finish(ns, True, flags)


def bench_k0(ns: argparse.Namespace) -> int:
    """K=0 tax of the *default* SpecConfig: ``BatchThreshold(0)`` (a speculative engine that
    never drafts) vs the baseline, side by side (interleaved), per concurrency level; the same
    with ``draft_state="warm"`` for comparison. Goal: ≤ 2 % at every level with the default."""
    levels = args.levels(ns)
    shape = args.spec(ns)
    prompts = args.prompts(ns)
    default_state = SpecConfig().draft_state
    arms: dict[str, Any] = {
        "baseline": None,
        f"k0 default ({default_state})": dataclasses.replace(shape, policy=BatchThreshold(0)),
        "k0 warm": dataclasses.replace(shape, policy=BatchThreshold(0), draft_state="warm"),
    }
    df, choices = args.sweep(ns, prompts, levels, lambda _: arms, need_draft=True,
                             name="k0_tax")
    flags = saved_flags(df)
    s = summarize(df)
    s["k0_tax_pct"] = 100.0 * (1.0 - s["vs_baseline"])
    step = s[s["arm"] == "baseline"].set_index("concurrency")["steady_step_ms"]
    s["k0_tax_step_pct"] = 100.0 * (s["steady_step_ms"] / s["concurrency"].map(step) - 1.0)
    cols = ["arm", "concurrency", "tok_s", "tok_s_lo", "tok_s_hi", "vs_baseline",
            "k0_tax_pct", "k0_tax_step_pct", "lossless", "flags"]
    show("K=0 tax: BatchThreshold(0) vs baseline (interleaved; default draft_state "
         f"{default_state!r} and 'warm')", s[[c for c in cols if c in s]])
    _stamp_sweep(df, flags, choices, "k0", s[[c for c in cols if c in s]],
                 {"default_draft_state": default_state})
    lossless = s["lossless"].dropna()
    return finish(ns, bool(lossless.all()), flags)
