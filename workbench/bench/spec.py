"""EAGLE-3 vs its own baseline at bs=1, greedy, arms interleaved per prompt (one run, ratios).

Every speculative output is compared with the baseline output token for token; a mismatch is
reported in the table (``lossless`` column), never hidden.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from tqdm.auto import tqdm

from workbench.bench.step_cost import PHASES
from workbench.config import SamplingParams, SpecConfig
from workbench.machine import machine_info

if TYPE_CHECKING:
    from workbench.core import RequestOutput
    from workbench.engine.engine import Engine

# prompts of the traced pass behind the ceiling (the baseline and the arms in turns per prompt)
STEP_COST_PROMPTS = 4
DEFAULT_ARMS: dict[str, SpecConfig | None] = {
    "baseline": None,
    "chain S5": SpecConfig(num_steps=5, topk=1),
    "tree S5 K4 N16": SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
    "tree S6 K8 N32": SpecConfig(num_steps=6, topk=8, num_draft_tokens=32),
}


def timed_arms(engine: Engine, prompt: Any, arms: dict[str, SpecConfig | None],
               sp: SamplingParams) -> list[tuple[str, RequestOutput, float, bool]]:
    """``prompt`` generated alone once per arm, in ``arms``' order: (arm, output, seconds,
    lossless); ``lossless`` = the same token ids as the baseline arm's (``spec`` None), so
    False for an arm before the baseline or in a run without one."""
    rows = []
    base: list[int] | None = None
    for name, spec in arms.items():
        t0 = time.perf_counter()
        out = engine.generate([prompt], sp, spec=spec)[0]
        dt = time.perf_counter() - t0
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
        from workbench.bench.sanity import sanity_flags

        return sanity_flags(self.summary, load=self.machine.get("load"))

    def save(self, folder: str | Path, name: str = "spec_bs1") -> Path:
        """``<name>_per_prompt.csv``, ``<name>.csv`` (summary with a ``flags`` column) and
        ``<name>.json`` (machine, load, flags, summary)."""
        from workbench.bench.sanity import mark, report

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
    and after is in ``machine["load"]``. With ``bound``, a traced pass over the first
    STEP_COST_PROMPTS prompts (the same run, after the timed one; the baseline and the arms in
    turns per prompt; ``workbench.bench.step_cost``) adds, per speculative arm, in
    plain-step units: ``verify_ratio`` (the target's forward + logits of a speculative step)
    and ``draft_ratio`` (its draft forwards: the tree's steps and the extend); ``bound`` =
    τ / verify_ratio (the speedup if drafting were free too); ``ceiling`` = τ / (verify_ratio +
    draft_ratio), the speedup if everything but the forwards — schedule, tree building,
    accept, commit, extend bookkeeping, Python — were free; ``of_ceiling`` = speedup /
    ceiling; ``overhead``, the per-step overhead over the step's forwards; and for whole prompts
    as the speedup measures them, ``ceiling_e2e`` = (p + n) / (p' + n · (verify_ratio +
    draft_ratio) / τ) with n = max_new_tokens − 1 decoded tokens, p the baseline's prefill step
    (``prefill_ratio``) and p' the arm's prefill forwards (target and draft), and
    ``of_ceiling_e2e``."""
    from workbench.bench.sanity import LoadSampler, mean_ci

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
    for r, i, p in tqdm(todo, desc="bench spec", unit="prompt", disable=not progress):
        for name, out, dt, lossless in timed_arms(engine, p, arms, sp):
            rows.append({"repeat": r, "prompt": i, "arm": name, "tokens": len(out.token_ids),
                         "seconds": dt, "tok_s": len(out.token_ids) / dt,
                         "tau": out.metrics.accept_length, "verify_ct": out.metrics.verify_ct,
                         "lossless": lossless})
    load.stop()
    df = pd.DataFrame(rows)
    g = df.groupby("arm", sort=False).agg(tokens=("tokens", "sum"), seconds=("seconds", "sum"),
                                          lossless=("lossless", "all"))
    # τ of the run as SGLang counts it: tokens per verify over all of them (a prompt with more
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
    if bound:
        from workbench.bench.step_cost import step_costs

        for name, cost in step_costs(engine, prompts[:STEP_COST_PROMPTS], arms, sp).items():
            g.loc[name, "verify_ratio"] = cost["verify_ratio"]
            g.loc[name, "bound"] = g.loc[name, "tau"] / cost["verify_ratio"]
            g.loc[name, "draft_ratio"] = cost["draft_ratio"]
            g.loc[name, "ceiling"] = g.loc[name, "tau"] / (cost["verify_ratio"] +
                                                           cost["draft_ratio"])
            g.loc[name, "of_ceiling"] = g.loc[name, "speedup"] / g.loc[name, "ceiling"]
            # the same "nothing but forwards" ceiling for what the speedup measures: whole
            # prompts, whose prefill (no speculation shortens it) precedes max_new_tokens − 1
            # decoded tokens
            n = max(1, max_new_tokens - 1)
            e2e = (cost["prefill_ratio"] + n) / (
                cost["prefill_fwd_ratio"] + n * (cost["verify_ratio"] + cost["draft_ratio"])
                / g.loc[name, "tau"])
            g.loc[name, "ceiling_e2e"] = e2e
            g.loc[name, "of_ceiling_e2e"] = g.loc[name, "speedup"] / e2e
            g.loc[name, "overhead"] = cost["overhead"]
            g.loc[name, "prefill_ratio"] = cost["prefill_ratio"]
            g.loc[name, "prefill_fwd_ratio"] = cost["prefill_fwd_ratio"]
            for k, v in cost.items():  # where the overhead sits: ms per step by phase
                if k.startswith("overhead_"):
                    g.loc[name, k] = v
    machine = machine_info()
    machine["load"] = load.as_dict()
    return SpecBenchResult(df, g.reset_index(), machine)


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
    from workbench.engine.engine import Engine as EngineCls

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
        from workbench.engine.prompts import tokenize

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
    """One line per arm with a ceiling: the speedup beside the ceiling measured in the run."""
    lines = []
    for r in summary.to_dict(orient="records"):
        if pd.isna(r.get("ceiling", float("nan"))):
            continue
        lines.append(
            f"{r['arm']}: {r['speedup']:.2f}x of a ceiling {r['ceiling']:.2f}x "
            f"(τ {r['tau']:.2f} / (verify {r['verify_ratio']:.2f} + drafts "
            f"{r['draft_ratio']:.2f} plain steps, forwards alone)) = {r['of_ceiling']:.2f} of "
            f"it; per-step overhead {100 * r['overhead']:.0f} % of its forwards")
        if not pd.isna(r.get("ceiling_e2e", float("nan"))):
            lines.append(
                f"  whole prompts (the prefill, {r['prefill_ratio']:.1f} plain steps, "
                f"included): ceiling {r['ceiling_e2e']:.2f}x, reached "
                f"{r['of_ceiling_e2e']:.2f} of it")
        parts = [f"{k} {r[f'overhead_{k}_ms']:.2f}" for k in PHASES
                 if not pd.isna(r.get(f"overhead_{k}_ms", float("nan")))]
        if parts:
            lines.append(f"  overhead ms per step by phase: {', '.join(parts)}")
    return lines
