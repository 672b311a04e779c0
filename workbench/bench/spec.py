"""EAGLE-3 vs its own baseline at bs=1, greedy, arms interleaved per prompt (one run, ratios).

Every speculative output is compared with the baseline output token for token; a mismatch is
reported in the table (``lossless`` column), never hidden.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from tqdm.auto import tqdm

import workbench as wb
from workbench.bench.cli_args import engine_overrides
from workbench.bench.sanity import LoadSampler, mark, report, sanity_flags
from workbench.bench.step_cost import PHASES, ForwardClock, decode_costs, forwards_ms, phase_costs
from workbench.config import SamplingParams, SpecConfig
from workbench.data_io import load_prompt_records
from workbench.engine.engine import Engine as EngineCls
from workbench.engine.prompts import tokenize
from workbench.machine import git_commit, machine_info
from workbench.stats import bootstrap_ratio, mean_ci

if TYPE_CHECKING:
    from workbench.core import RequestOutput
    from workbench.engine.engine import Engine

# prompts of the traced pass that says where the overhead sits (the arms in turns per prompt)
STEP_COST_PROMPTS = 4
DEFAULT_ARMS: dict[str, SpecConfig | None] = {
    "baseline": None,
    "chain S5": SpecConfig(num_steps=5, topk=1),
    "tree S5 K4 N16": SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
    "tree S6 K8 N32": SpecConfig(num_steps=6, topk=8, num_draft_tokens=32),
}


def timed_arms(engine: Engine, prompt: Any, arms: dict[str, SpecConfig | None],
               sp: SamplingParams, clock: ForwardClock | None = None
               ) -> list[tuple[str, RequestOutput, float, bool]]:
    """``prompt`` generated alone once per arm, in ``arms``' order: (arm, output, seconds,
    lossless); ``lossless`` = the same token ids as the baseline arm's (``spec`` None), so
    False for an arm before the baseline or in a run without one. With a running ``clock``
    (``step_cost.ForwardClock``), each arm's steps are also appended to ``clock.by_arm``."""
    rows = []
    base: list[int] | None = None
    for name, spec in arms.items():
        n0 = len(clock.rows) if clock is not None else 0
        t0 = time.perf_counter()
        out = engine.generate([prompt], sp, spec=spec)[0]
        dt = time.perf_counter() - t0
        if clock is not None:
            clock.by_arm.setdefault(name, []).append(clock.rows[n0:])
        if spec is None:
            base = out.token_ids
        rows.append((name, out, dt, base is not None and out.token_ids == base))
    return rows


@dataclass(frozen=True)
class SpecBenchResult:
    """``per_prompt`` rows, per-arm ``summary`` and ``machine`` (with ``load`` before/after).
    :meth:`flags` runs the sanity checks (``workbench.bench.sanity``) on the summary."""

    per_prompt: pd.DataFrame
    summary: pd.DataFrame
    machine: dict[str, Any]

    def flags(self) -> list[Any]:
        return sanity_flags(self.summary, load=self.machine.get("load"))

    def save(self, folder: str | Path, name: str = "spec_bs1") -> Path:
        """``<name>_per_prompt.csv``, ``<name>.csv`` (summary with a ``flags`` column) and
        ``<name>.json`` (machine, load, flags, summary)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        flags = self.flags()
        summary = mark(self.summary, flags)
        self.per_prompt.to_csv(out / f"{name}_per_prompt.csv", index=False)
        summary.to_csv(out / f"{name}.csv", index=False)
        doc = report(flags, self.machine.get("load"), self.machine)
        doc["summary"] = json.loads(summary.to_json(orient="records"))
        (out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
        return out / f"{name}.json"


def run_spec_bench(engine: Engine, prompts: list[str],
                   arms: dict[str, SpecConfig | None] | None = None,
                   max_new_tokens: int = 128, warmup: int = 1,
                   progress: bool = True, repeats: int = 1,
                   bound: bool = False) -> SpecBenchResult:
    """bs=1 greedy. Rows: one per (repeat, prompt, arm) with tokens, seconds, tok/s, τ,
    lossless; arms interleaved per prompt (they share the machine's noise).

    Summary per arm: summed tokens / seconds → ``tok_s``, ``speedup`` over baseline, τ, and
    with ``repeats`` > 1 the 95 % confidence intervals ``tok_s_lo/hi`` and ``speedup_lo/hi``
    over the repeats (each repeat's own tok/s and own baseline ratio). The load average before
    and after is in ``machine["load"]``. With ``bound`` (and a baseline arm), the timed arms run
    inside a ``step_cost.ForwardClock`` (per step: the model forwards' ms; per row
    ``forward_seconds``), which adds per speculative arm, from those same steps (decode steps
    only, the prefill left out), in plain-step units (the baseline's median decode step):
    ``verify_ratio`` (the target's forward + logits) and ``draft_ratio`` (the draft forwards:
    the tree's steps and the extend); ``bound`` = τ / verify_ratio (the speedup if drafting were
    free too); ``ceiling`` = τ / (verify_ratio + draft_ratio), a decode step's speedup if
    everything but the forwards — schedule, tree building, accept, commit, extend bookkeeping,
    Python — were free; ``overhead``, the median decode step's time beyond its forwards over its
    forwards, and ``of_ceiling_step`` = 1 / (1 + overhead), the share of the ceiling a decode
    step reaches; ``of_ceiling`` = speedup / ceiling (a whole-prompt speedup over a per-step
    ceiling: the prefill, which no speculation shortens, lowers it); for whole prompts as the
    speedup measures them, ``ceiling_e2e`` = the baseline's seconds / the arm's forwards'
    seconds and ``of_ceiling_e2e`` = the arm's forwards' seconds / its seconds (= speedup /
    ceiling_e2e); ``prefill_ratio``, the baseline's prefill step. A traced pass over the first
    STEP_COST_PROMPTS prompts (after the timed one; the arms in turns per
    prompt) then says where the overhead sits: ``overhead_<phase>_ms``."""
    if repeats < 1:
        raise ValueError(f"run_spec_bench: repeats must be >= 1, got {repeats}")
    arms = arms or DEFAULT_ARMS
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for spec in arms.values():  # warm-up: allocator, rotary tables, first-call overheads
        for p in prompts[:warmup]:
            engine.generate([p], sp, spec=spec)
    rows = []
    load = LoadSampler().start()
    todo = [(r, i, p) for r in range(repeats) for i, p in enumerate(prompts)]
    # with ``bound`` the timed arms run inside the forward clock (a few µs per step): the
    # ceiling then comes from the very steps the speedup does
    with ForwardClock(engine) if bound else contextlib.nullcontext() as clock:
        for r, i, p in tqdm(todo, desc="bench spec", unit="prompt", disable=not progress):
            for name, out, dt, lossless in timed_arms(engine, p, arms, sp, clock):
                rows.append({"repeat": r, "prompt": i, "arm": name,
                             "tokens": len(out.token_ids), "seconds": dt,
                             "tok_s": len(out.token_ids) / dt,
                             "tau": out.metrics.accept_length, "verify_ct": out.metrics.verify_ct,
                             "lossless": lossless})
                if clock is not None:
                    rows[-1]["forward_seconds"] = forwards_ms(clock.by_arm[name][-1]) / 1e3
    load.stop()
    df = pd.DataFrame(rows)
    g = df.groupby("arm", sort=False).agg(tokens=("tokens", "sum"), seconds=("seconds", "sum"),
                                          lossless=("lossless", "all"))
    # τ of the run as SGLang counts it: tokens per verify over all verifies (a prompt with more
    # verifies weighs more, as it does in the summed seconds the speedup comes from)
    verifies = df.groupby("arm", sort=False)["verify_ct"].sum()
    emitted = (df["tau"] * df["verify_ct"]).groupby(df["arm"], sort=False).sum()
    g.insert(2, "tau", (emitted / verifies).where(verifies > 0, 1.0))
    g["tok_s"] = g["tokens"] / g["seconds"]
    base = g["tok_s"].get("baseline", float("nan"))
    g["speedup"] = g["tok_s"] / base
    if repeats > 1:
        per = df.groupby(["arm", "repeat"], sort=False)[["tokens", "seconds"]].sum()
        per["tok_s"] = per["tokens"] / per["seconds"]
        for arm in g.index:
            ts = per.loc[arm, "tok_s"]
            _, lo, hi = mean_ci(ts.tolist())
            g.loc[arm, ["tok_s_lo", "tok_s_hi"]] = [lo, hi]
            if "baseline" in g.index:
                ratio = (ts / per.loc["baseline", "tok_s"]).tolist()
                _, lo, hi = mean_ci(ratio)
                g.loc[arm, ["speedup_lo", "speedup_hi"]] = [lo, hi]
    if clock is not None and "baseline" in clock.by_arm:
        _ceilings(g, df, clock.by_arm)
        for name, cost in phase_costs(engine, prompts[:STEP_COST_PROMPTS], arms, sp).items():
            for k, v in cost.items():  # where the overhead sits: ms per step by phase
                g.loc[name, k] = v
    machine = machine_info()
    machine["load"] = load.as_dict()
    return SpecBenchResult(df, g.reset_index(), machine)


def _ceilings(g: pd.DataFrame, df: pd.DataFrame,
              by_arm: dict[str, list[list[dict[str, float]]]]) -> None:
    """The ceiling columns of every speculative arm (``run_spec_bench``), from the timed pass's
    forward clock rows; ``g`` is the per-arm summary, ``df`` the per-prompt rows."""
    base = [r for call in by_arm["baseline"] for r in call]
    fwd_s = df.groupby("arm", sort=False)["forward_seconds"].sum()
    base_s = g.loc["baseline", "seconds"]
    for name, calls in by_arm.items():
        steps = [r for call in calls for r in call]
        if name == "baseline" or not any(r["draft_ms"] > 0 for r in steps):
            continue
        cost = decode_costs(base, steps)
        g.loc[name, "verify_ratio"] = cost["verify_ratio"]
        g.loc[name, "bound"] = g.loc[name, "tau"] / cost["verify_ratio"]
        g.loc[name, "draft_ratio"] = cost["draft_ratio"]
        g.loc[name, "ceiling"] = g.loc[name, "tau"] / (cost["verify_ratio"] +
                                                       cost["draft_ratio"])
        g.loc[name, "of_ceiling"] = g.loc[name, "speedup"] / g.loc[name, "ceiling"]
        g.loc[name, "overhead"] = cost["overhead"]
        # a decode step's own speedup over a plain one is τ · plain / step, so the share of its
        # ceiling it reaches is forwards / step: 1 / (1 + overhead), measured per step
        g.loc[name, "of_ceiling_step"] = 1.0 / (1.0 + cost["overhead"])
        # whole prompts as the speedup measures them, the prefill included: the baseline's
        # seconds over this arm's forwards' seconds (everything else free), and the share of
        # the arm's seconds its forwards took (= speedup / that ceiling)
        g.loc[name, "ceiling_e2e"] = base_s / fwd_s[name]
        g.loc[name, "of_ceiling_e2e"] = fwd_s[name] / g.loc[name, "seconds"]
        g.loc[name, "prefill_ratio"] = cost["prefill_ratio"]


def dtype_effect(engine: Engine, prompts: list[Any], max_new_tokens: int = 64,
                 repeats: int = 2) -> dict[str, Any] | None:
    """What a reduced-precision engine (``EngineConfig.dtype`` bfloat16/float16) does to the
    numbers, against a float32 engine on the same models, in the same run (None for float32).

    ``agreement``: the share of greedy output positions where the two baselines emit the same
    token (per prompt and overall), ``first_divergence`` per prompt; ``max_logit_diff`` /
    ``mean_logit_diff``: |logits| difference of the two targets' dense forwards over each
    prompt followed by the float32 output (teacher-forced, every position); ``tok_s`` of each
    baseline, the two timed in turns per prompt ``repeats`` times, and ``speedup`` (reduced
    over float32)."""
    import dataclasses

    import torch

    cfg = engine.config
    if cfg.dtype == "float32":
        return None

    ref = EngineCls.from_pretrained(engine.model_path, config=dataclasses.replace(
        cfg, dtype="float32"))
    try:
        sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        ref.generate(prompts[:1], sp)  # warm-up
        secs = {"float32": 0.0, cfg.dtype: 0.0}
        toks = dict.fromkeys(secs, 0)
        outs: dict[str, list[list[int]]] = {k: [] for k in secs}
        for r in range(repeats):
            for p in prompts:
                for name, e in (("float32", ref), (cfg.dtype, engine)):
                    t0 = time.perf_counter()
                    o = e.generate([p], sp)[0]
                    secs[name] += time.perf_counter() - t0
                    toks[name] += len(o.token_ids)
                    if r == 0:
                        outs[name].append(o.token_ids)

        agree, first, max_d, mean_d = [], [], 0.0, []
        ta, tb = ref.runner.target, engine.runner.target
        assert ta is not None and tb is not None  # loaded at init
        for p, a, b in zip(prompts, outs["float32"], outs[cfg.dtype], strict=True):
            n = min(len(a), len(b))
            same = [x == y for x, y in zip(a[:n], b[:n], strict=True)]
            agree.append(sum(same) / max(1, n))
            first.append(same.index(False) if False in same else n)
            ids = torch.tensor([[*tokenize(ref.tokenizer, ta.config.vocab_size, p), *a]],
                               dtype=torch.int64)
            with torch.inference_mode():
                la, lb = ta.forward_dense(ids)[0].float(), tb.forward_dense(ids)[0].float()
            d = (la - lb).abs()
            max_d = max(max_d, float(d.max()))
            mean_d.append(float(d.mean()))
        tok_s = {k: toks[k] / secs[k] for k in secs}
        return {"dtype": cfg.dtype, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                "agreement": sum(agree) / len(agree), "agreement_per_prompt": agree,
                "first_divergence": first, "max_logit_diff": max_d,
                "mean_logit_diff": sum(mean_d) / len(mean_d),
                "tok_s": tok_s, "speedup": tok_s[cfg.dtype] / tok_s["float32"]}
    finally:
        ref.close()


def dtype_effect_line(eff: dict[str, Any]) -> str:
    """One line: the reduced dtype's speed and numerical effect against float32."""
    tok_s = eff["tok_s"]
    return (f"dtype {eff['dtype']} vs float32 (baselines, same run): {tok_s[eff['dtype']]:.1f}"
            f" vs {tok_s['float32']:.1f} tok/s = {eff['speedup']:.2f}x; greedy tokens agree"
            f" with float32 at {100 * eff['agreement']:.0f} % of positions ({eff['prompts']} "
            f"prompts x {eff['max_new_tokens']}, first divergence at "
            f"{min(eff['first_divergence'])}-{max(eff['first_divergence'])}); logits differ by "
            f"{eff['mean_logit_diff']:.3f} on average, {eff['max_logit_diff']:.2f} at most. "
            "Speculative outputs are compared with this dtype's own baseline (lossless column).")


def ceiling_lines(summary: pd.DataFrame) -> list[str]:
    """Per arm with a ceiling: the speedup beside the ceilings measured in the same timed run
    (per decode step, and over whole prompts), then where the overhead sits."""
    lines = []
    for r in summary.to_dict(orient="records"):
        if pd.isna(r.get("ceiling", float("nan"))):
            continue
        lines.append(
            f"{r['arm']}: {r['speedup']:.2f}x. Per decode step: ceiling {r['ceiling']:.2f}x "
            f"(τ {r['tau']:.2f} / (verify {r['verify_ratio']:.2f} + drafts "
            f"{r['draft_ratio']:.2f} plain steps, forwards alone)); a step reaches "
            f"{r['of_ceiling_step']:.2f} of it (overhead {100 * r['overhead']:.0f} % of its "
            f"forwards); the whole-prompt {r['speedup']:.2f}x is {r['of_ceiling']:.2f} of it")
        lines.append(
            f"  whole prompts (the prefill, {r['prefill_ratio']:.1f} plain steps, included): "
            f"ceiling {r['ceiling_e2e']:.2f}x (the baseline's time over this arm's forwards' "
            f"time), reached {r['of_ceiling_e2e']:.2f} of it")
        parts = [f"{k} {r[f'overhead_{k}_ms']:.2f}" for k in PHASES
                 if not pd.isna(r.get(f"overhead_{k}_ms", float("nan")))]
        if parts:
            lines.append(f"  overhead ms per step by phase (traced pass): {', '.join(parts)}")
    return lines


# -- τ by category on a prompt file (held-out chat prompts through the chat template) ---------

def run_tau_bench(engine: Engine, records: list[dict[str, Any]], spec: SpecConfig,
                  max_new_tokens: int = 128, batch: int = 16,
                  progress: bool = True) -> dict[str, Any]:
    """τ per category (``kind``), overall and per draft depth on prompt records, greedy.

    ``records``: dicts with ``id``, ``kind`` and ``prompt`` (text, token ids or chat messages;
    ``workbench.data_io.load_prompt_records``). Each prompt runs once with ``spec`` and
    once without (batches of ``batch``: τ counts the verify steps of each request, which the
    batch does not change); ``lossless`` = every speculative output equals the plain one.
    τ = emitted tokens / verify steps summed over a category's prompts; per depth d (1..S)
    the share of verify steps that accepted at least d drafted tokens. Intervals: 95 %
    percentile bootstrap over prompts. Times are not measured here (``run_spec_bench`` is)."""
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    rows = []
    load = LoadSampler().start()
    for lo in tqdm(range(0, len(records), batch), desc="bench tau", unit="batch",
                   disable=not progress):
        chunk = records[lo : lo + batch]
        prompts = [r["prompt"] for r in chunk]
        plain = engine.generate(prompts, sp, spec=None)
        fast = engine.generate(prompts, sp, spec=spec)
        for r, a, b in zip(chunk, plain, fast, strict=True):
            acc = list(b.metrics.accept_lengths)
            rows.append({"id": r["id"], "kind": r["kind"], "tokens": len(b.token_ids),
                         "verify_ct": len(acc), "emitted": sum(acc),
                         "accepted_ge": [sum(x - 1 >= d for x in acc)
                                         for d in range(1, spec.num_steps + 1)],
                         "lossless": list(a.token_ids) == list(b.token_ids)})
    load.stop()

    def stats(rs: list[dict[str, Any]]) -> dict[str, Any]:
        den = [r["verify_ct"] for r in rs]
        tau, tlo, thi = bootstrap_ratio([r["emitted"] for r in rs], den)
        depth = []
        for d in range(spec.num_steps):
            p, plo, phi = bootstrap_ratio([r["accepted_ge"][d] for r in rs], den)
            depth.append({"depth": d + 1, "accept_rate": p, "lo": plo, "hi": phi})
        return {"prompts": len(rs), "tokens": sum(r["tokens"] for r in rs),
                "verify_steps": sum(den), "tau": tau, "tau_lo": tlo, "tau_hi": thi,
                "per_depth": depth, "lossless": all(r["lossless"] for r in rs)}

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    machine = machine_info()
    machine["load"] = load.as_dict()
    return {"spec": {"num_steps": spec.num_steps, "topk": spec.topk,
                     "num_draft_tokens": spec.num_draft_tokens},
            "max_new_tokens": max_new_tokens, "overall": stats(rows),
            "by_kind": {k: stats([r for r in rows if r["kind"] == k]) for k in kinds},
            "per_prompt": rows, "machine": machine}


def tau_table(res: dict[str, Any]) -> pd.DataFrame:
    """One row per category and one ``overall``: τ [lo, hi], acceptance per depth."""
    out = []
    for name, s in [*res["by_kind"].items(), ("overall", res["overall"])]:
        row = {"kind": name, "prompts": s["prompts"], "tau": round(s["tau"], 2),
               "tau_95": f"[{s['tau_lo']:.2f}, {s['tau_hi']:.2f}]", "lossless": s["lossless"]}
        for d in s["per_depth"]:
            row[f"acc_d{d['depth']}"] = round(d["accept_rate"], 3)
        out.append(row)
    return pd.DataFrame(out)


def tau_main(argv: list[str] | None = None) -> int:
    """``python -m workbench.bench.spec``: τ per category of a prompt file, saved as JSON."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m workbench.bench.spec",
                                 description=tau_main.__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts-file", required=True,
                    help="jsonl records (id, kind, prompt; chat: messages or turns)")
    ap.add_argument("--chat-template", action="store_true",
                    help="send text prompts as one user turn through the model's chat template")
    ap.add_argument("--spec", default="5,4,16", metavar="S,K,N")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="data/results/real/tau_heldout.json")
    ap.add_argument("--engine", default="", metavar="KEY=VALUE,...",
                    help="EngineConfig overrides, e.g. draft_dtype=same")
    ns = ap.parse_args(argv)
    import dataclasses


    s, k, n = (int(v) for v in ns.spec.split(","))
    spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
    records = load_prompt_records(ns.prompts_file, chat=ns.chat_template)
    cfg = dataclasses.replace(wb.EngineConfig(max_batch_size=ns.batch,
                                              kv_budget_tokens=ns.batch * 2048),
                              **engine_overrides(ns))
    engine = wb.Engine.from_pretrained(ns.model, draft=ns.draft, config=cfg)
    try:
        res = run_tau_bench(engine, records, spec, ns.max_new_tokens, ns.batch)
        # the draft's compute dtype changes its proposals (never the outputs): record it
        res["engine_choices"] = {k: {"choice": v.get("choice"), "source": v.get("source")}
                                 for k, v in engine.choices.items() if isinstance(v, dict)}
    finally:
        engine.close()
    print(tau_table(res).to_string(index=False))
    # both arms (plain and speculative) run the same weights: packed codes or dequantised
    res["weights"] = res["engine_choices"].get("weights", {}).get("choice", "dequant")
    print(f"weights: {res['weights']} (both arms)")
    commit = git_commit() or ""
    res.update({"command": "python -m workbench.bench.spec " + " ".join(sys.argv[1:] if argv
                                                                         is None else argv),
                "commit": commit, "model": ns.model, "draft": ns.draft,
                "prompts_file": ns.prompts_file, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                      time.gmtime())})
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"results: {out}")
    return 0 if res["overall"]["lossless"] else 1


if __name__ == "__main__":
    raise SystemExit(tau_main())
