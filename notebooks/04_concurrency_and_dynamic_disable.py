# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Concurrency and dynamic disable: when should speculation switch itself off?
#
# **You will learn** why EAGLE-3 can win at batch 1 and lose under load, how to find the
# crossover and turn it into a `BatchThreshold` (only when repeats agree), how latency is
# distributed (TTFT, TPOT and ITL CDFs with p99), what the draft costs while speculation is
# off (warm vs cold draft state), and how the policies compare on goodput (output tokens/s).
#
# **The story.** An SGLang server ran Kimi-K2.5 (INT4) with EAGLE-3 on 8 Blackwell GPUs. A
# single stream went from 54.1 tok/s (baseline) to 96.1 tok/s with EAGLE-3 — but under parallel
# load the baseline saturated near 773 tok/s while EAGLE-3 topped out near 354: verifying
# N draft tokens per request costs real compute once the batch fills the GPU. The fix was
# *dynamic speculation disable*: stop drafting when the decode batch exceeds a threshold
# (`spec_disable_batch_threshold`). Its first version crashed the server on the first decode
# request (that is notebook 05). Here we measure the same trade-off on the workbench engine.

# %% tags=["parameters"]
import os

FAST = os.environ.get("WORKBENCH_FAST") == "1"
LEVELS = (1, 2, 4) if FAST else (1, 2, 4, 8)
MAX_NEW_TOKENS = 12 if FAST else 16  # the whole page must fit an 8-minute `make report`
REPEATS = 2 if FAST else 3  # intervals need repeats; a suggestion needs them to agree
FLIP_LEVELS = (1, 4)  # the warm/cold switch-cost arms: two levels, one repeat

# %%
# NBVAL_IGNORE_OUTPUT
import pandas as pd

import workbench as wb
from workbench.bench import sanity
from workbench.bench.concurrency import (
    default_arms,
    find_threshold,
    run_concurrency,
    summarize,
    switch_costs,
)
from workbench.machine import format_machine, machine_info
from workbench.viz import figures as F
from workbench.train.demo_models import REPO_ROOT, demo_models
from IPython.display import display

from workbench.viz.report import conditions_block, highlight_flagged, ratio_ci, sanity_block
from workbench.viz.widgets import SweepProgress

models = demo_models(fast=FAST)
engine = wb.Engine.from_pretrained(models.target, draft=models.draft,
                                   config=wb.EngineConfig(max_batch_size=max(LEVELS)))
prompts = list(models.prompts)
print(models.describe())

# %% [markdown]
# ## The arms
# One engine, one draft head, several policies. The seeds ran a chain (`topk=1`); so do we.
# `default_arms` calibrates a cost model on this machine (step times by batch size, spec and
# plain) and measures τ on these prompts. The goodput policy uses both; the threshold arm
# takes its `n` from them too: `BatchThreshold.from_cost_model` puts the cut-off where plain
# decoding is predicted to catch up, on this machine, not where someone guessed.

# %%
spec = wb.SpecConfig(num_steps=4, topk=1)
all_arms = default_arms(engine, spec=spec, threshold="auto", prompts=prompts,
                        max_new_tokens=MAX_NEW_TOKENS)
threshold_policy = all_arms["threshold"].policy
print(f"threshold arm: BatchThreshold({threshold_policy.n}) — {threshold_policy.basis.reason()}")
display(conditions_block(engine.choices, "this page's engine"))
flip_arms = {a: s for a, s in all_arms.items() if a == "baseline" or a.startswith("flip")}
arms = {a: s for a, s in all_arms.items() if not a.startswith("flip")}

# %%
# NBVAL_CHECK_OUTPUT
for name, s in all_arms.items():
    print(f"{name:10s}", "baseline (no draft)" if s is None else
          f"{type(s.policy).__name__}, draft {s.draft_state}")

# %% [markdown]
# ## The sweep
# Closed loop: at concurrency c, c requests stay in flight (a new one joins when one finishes).
# Every arm gets its own engine and the arms of a level advance **one step each per round**,
# each timed on its own clock: they share the same stretch of the machine's life, so its drift
# cancels from the ratios. Each level is repeated; the load average is sampled before and after.
# Progress and tok/s update live, one point per arm and level.

# %%
cfg = wb.EngineConfig(max_batch_size=max(LEVELS), kv_budget_tokens=8192)
engines = {a: wb.Engine.from_pretrained(models.target, draft=models.draft, config=cfg)
           for a in all_arms}

# %%
# NBVAL_IGNORE_OUTPUT
progress = SweepProgress(len(LEVELS) * len(arms), "concurrency sweep", x="concurrency",
                         y="tok_s", color="arm")
progress

# %%
frames = []
with sanity.LoadSampler() as load:
    for i, c in enumerate(progress.iter(LEVELS)):
        df = run_concurrency(engine, prompts, levels=[c], arms=arms,
                             max_new_tokens=MAX_NEW_TOKENS, repeats=REPEATS, warmup=i == 0,
                             progress=False, engines=engines)
        for arm, g in df.groupby("arm", sort=False):
            progress.update(arm=arm, concurrency=c, tok_s=g.tok_s.mean())
        frames.append(df)
results = pd.concat(frames, ignore_index=True)
summary = summarize(results)

# %%
# NBVAL_CHECK_OUTPUT
print("every arm matches the baseline token for token:", bool(summary.lossless.dropna().all()))

# %% [markdown]
# The table: means over the repeats, the tok/s interval (95 %, over repeats, log scale), the
# ratio to the baseline — per repeat against the baseline *of the same interleaved run*, then
# the geometric mean with its 95 % interval and n (the same numbers the figure and the prose
# below use) — and the sanity flags of each row (amber rows failed a check; the block below
# says which and why).

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.viz import prose as P
from workbench.viz.report import paired_ratio

flags = sanity.sanity_flags(results, load=load.as_dict())
# tok/s interval on the log scale (geometric, stays above 0 tok/s), replacing any other
tok_ci = ratio_ci(results, ["arm", "concurrency"], "tok_s").drop(columns=["tok_s", "n"])
summary = summary.drop(columns=[c for c in ("tok_s_lo", "tok_s_hi") if c in summary])
ratio = paired_ratio(results)
table = sanity.mark(summary.merge(tok_ci, on=["arm", "concurrency"]).merge(
    ratio, on=["arm", "concurrency"], how="left"), flags)
ratio = ratio.merge(table[["arm", "concurrency", "flags"]], on=["arm", "concurrency"])
print(format_machine(machine_info()),
      f"· greedy · {len(prompts)} prompts · {MAX_NEW_TOKENS} new tokens · {REPEATS} repeats · "
      f"load {load.before[0]:.2f} → {load.after[0]:.2f}")
shown = table[table.arm.isin(["baseline", "eagle3", "never", "threshold", "goodput"])]
# n: repeats behind the ratio; requests (TTFT) and tokens (ITL) per repeat behind each p50
highlight_flagged(shown[["arm", "concurrency", "tok_s", "tok_s_lo", "tok_s_hi", "ratio",
                         "ratio_lo", "ratio_hi", "n", "requests", "tokens", "itl_p50_ms",
                         "ttft_p50_ms", "tau", "spec_share", "flags"]])

# %%
# NBVAL_IGNORE_OUTPUT
sanity_block(flags, "the concurrency sweep")

# %% [markdown]
# ## The envelope
# Throughput, inter-token latency and time to first token against concurrency, each on its own
# axis (latencies on a log scale ticked in ms). A band marks where always-on EAGLE-3 falls below
# the baseline — only where the intervals of the ratio resolve such a crossover; otherwise the
# figure says it is not resolved at this noise. ⚠ marks flagged rows.

# %%
# NBVAL_IGNORE_OUTPUT
F.concurrency_curves(table[table.arm.isin(["baseline", "eagle3", "never", "threshold",
                                           "goodput"])], ratio=ratio)

# %% [markdown]
# ## Speedup vs batch size, with intervals
# The same paired ratios as the table: points are the geometric mean over the repeats, bars
# its 95 % interval, n beside each point. A marker is green/red only when its interval lies
# wholly above/below 1×; grey means this run cannot tell the arm from the baseline there.

# %%
# NBVAL_IGNORE_OUTPUT
F.speedup_vs_batch(ratio[ratio.arm.isin(["eagle3", "never", "threshold", "goodput"])],
                   value="ratio")

# %% [markdown]
# ## Choosing the threshold
# `find_threshold` takes the smallest level where the baseline is at least as fast as
# EAGLE-3 and proposes the largest level below it as `BatchThreshold(n)` (0: never speculate).
# A proposal is only worth following when the data behind it are consistent: every level's
# EAGLE-3/baseline interval on one side of 1.0, and no sanity flag on those rows. The cell
# below checks that before it suggests anything.

# %%
# NBVAL_IGNORE_OUTPUT
th = find_threshold(results)
e3 = ratio[ratio.arm == "eagle3"].set_index("concurrency")
e3_claims = {int(c): P.ratio(f"always-on EAGLE-3 at c = {int(c)}", r.ratio, r.ratio_lo,
                             r.ratio_hi, n=int(r.n)) for c, r in e3.iterrows()}
undecided = [c for c, cl in e3_claims.items() if not cl.resolved]
flagged_rows = table[table.arm.isin(["baseline", "eagle3"]) & (table["flags"] != "")]
print(th.table.round(2).to_string(index=False))
parts = [x for cl in e3_claims.values() for x in (cl, P.BR)]
if undecided or len(flagged_rows) or REPEATS < 2:
    why = []
    if undecided:
        why.append(f"the EAGLE-3/baseline interval contains 1× at c = {undecided}")
    if len(flagged_rows):
        why.append("sanity flags on " + ", ".join(
            f"{r.arm}@c={r.concurrency}: {r.flags}" for r in flagged_rows.itertuples()))
    parts += ["**No threshold suggested** — the data are not consistent enough: ",
              "; ".join(why), f". (The point estimates alone would say crossover "
              f"{th.crossover}, BatchThreshold({th.suggested_n}): not a finding at this noise.)"]
else:
    parts += [f"Crossover at c = {th.crossover}: suggested BatchThreshold({th.suggested_n}) "
              "(every interval on one side of 1×, no flags)."]
P.say(*parts)

# %% [markdown]
# How close did the threshold arm (the measured `BatchThreshold(n)` above, `draft_state=auto`)
# and the goodput policy come to the upper envelope — the better of baseline and always-on
# EAGLE-3 at each level, per repeat? Each repeat's policy tok/s over that repeat's envelope,
# geometric mean and interval over the repeats; "within 5 %" only when the whole interval is
# above 0.95:

# %%
# NBVAL_IGNORE_OUTPUT
wide = results.pivot_table(index=["concurrency", "repeat"], columns="arm", values="tok_s")
wide["envelope"] = wide[["baseline", "eagle3"]].max(axis=1)
env_rows = []
for arm in ("threshold", "goodput"):
    for c, g in wide.groupby(level="concurrency"):
        m, lo, hi, n = P.ratio_of((g[arm] / g["envelope"]).tolist())
        env_rows.append({"arm": arm, "concurrency": c, "of_envelope": m, "lo": lo, "hi": hi,
                         "n": n})
env = pd.DataFrame(env_rows)
print(env.round(3).to_string(index=False))
P.say(*[x for r in env.itertuples() for x in (
    P.ratio(f"{r.arm} at c = {r.concurrency}", r.of_envelope, r.lo, r.hi, n=r.n, ref=0.95,
            above="is within 5 % of", below="falls more than 5 % below",
            against="the envelope"), P.BR)])

# %% [markdown]
# ## Latency distributions
# Percentiles hide the shape. Every TTFT, time per output token (TPOT) and inter-token gap (ITL)
# of a closed-loop run at the lowest and the highest level, baseline vs always-on EAGLE-3, on
# log axes ticked in ms (a queued first token and a plain step differ by orders of magnitude).
# Every percentile comes with its n, and a p99 needs at least 100 samples (with fewer, the
# "p99" is the largest sample or close to it): a run too short for one says n/a.

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.viz.latency import latency_samples

lat = latency_samples(engines["baseline"], prompts, {"baseline": None, "eagle3": arms["eagle3"]},
                      levels=[LEVELS[0], LEVELS[-1]], max_new_tokens=MAX_NEW_TOKENS)
# n beside every percentile; no p99 from fewer than F.MIN_P99_SAMPLES samples
pct = lat.groupby(["arm", "concurrency", "metric"]).ms.agg(
    n="size", p50_ms=lambda x: F.percentile_text(x.tolist(), 50)[0],
    p99_ms=lambda x: F.percentile_text(x.tolist(), 99)[0])
pct["p99_ms"] = [f"{v:.1f}" if v == v and v is not None else f"n/a (n < {F.MIN_P99_SAMPLES})"
                 for v in pct.p99_ms]
pct.unstack("metric").round(1)

# %%
# NBVAL_IGNORE_OUTPUT
for metric in ("ttft", "tpot", "itl"):
    F.latency_cdf(lat[lat.metric == metric].rename(columns={"ms": f"{metric}_ms"}),
                  f"{metric}_ms", dash_by="concurrency").show()

# %% [markdown]
# ## What a switch costs
# The `flip_warm` / `flip_cold` arms turn speculation on and off at random (p = 0.5) so every
# step is a potential switch. Cold pays when speculation comes back (draft catch-up); warm pays
# on every plain step. The policy arms (`never`, `threshold`, `goodput`) use
# `draft_state="auto"`: warm for the first plain steps of an off stretch (short flips stay
# cheap), cold after that. The `never` arm measures what an idle speculative engine still
# costs — the **K=0 tax** (flagged `never_vs_baseline` when it exceeds 5 %). The flip arms
# run at two levels, once each (they measure a per-step cost, not a throughput ratio; n is the
# switches behind each bar, and a cost below 0 ms is flagged as noise on the figure).

# %%
# NBVAL_IGNORE_OUTPUT
flips = run_concurrency(engine, prompts, levels=FLIP_LEVELS, arms=flip_arms,
                        max_new_tokens=MAX_NEW_TOKENS, progress=False,
                        engines=engines)
flip_sum = summarize(flips).set_index(["arm", "concurrency"])
costs = switch_costs(flips)
for state in ("warm", "cold"):  # n of each switch cost: the switches behind it
    costs[f"{state}_switches"] = [int(flip_sum.loc[(f"flip_{state}", c), "switches"])
                                  for c in costs.concurrency]
print("flip arms lossless:", bool(flip_sum.lossless.dropna().all()))
F.warm_vs_cold(costs)

# %%
# NBVAL_IGNORE_OUTPUT
neg = [(st, int(r.concurrency), getattr(r, f"{st}_switch_extra_ms"))
       for r in costs.itertuples() for st in ("warm", "cold")
       if getattr(r, f"{st}_switch_extra_ms") < 0]
P.say(f"{len(neg)} of {2 * len(costs)} switch costs came out below 0 ms"
      + (": " + ", ".join(f"{st} at c = {c}: {v:.1f} ms" for st, c, v in neg)
         + " — a step after a switch is not cheaper than one without; these differences are "
           "noise larger than the cost (one repeat per level), not savings." if neg else "."))

# %%
# NBVAL_IGNORE_OUTPUT
table[table.arm == "never"][["concurrency", "tok_s", "k0_tax", "k0_tax_step", "flags"]].round(3)

# %% [markdown]
# ## Watching a policy decide
# Six requests of different lengths under `BatchThreshold(2)`: the engine decodes plainly while
# more than two requests run, then speculates as they finish.

# %%
# NBVAL_IGNORE_OUTPUT
import dataclasses

lengths = [wb.SamplingParams(max_new_tokens=8 * (i + 1), ignore_eos=True) for i in range(6)]
with wb.trace(engine) as tr:
    engine.generate((prompts * 2)[:6], lengths,
                    spec=dataclasses.replace(spec, policy=wb.BatchThreshold(2)))
F.policy_timeline(tr.frame("policy"), threshold=2)

# %%
# NBVAL_CHECK_OUTPUT
pol = tr.frame("policy")
print("speculated only at decode batch <= 2:", bool((pol[pol.speculate].decode_batch <= 2).all()))
print("decoded plainly above it:", bool((~pol[pol.decode_batch > 2].speculate).all()))

# %% [markdown]
# ## A saved run
# `python -m workbench bench concurrency` writes `data/results/concurrency.csv` and `.json`
# (the shipped models; or the GPU box through `--url`). If one exists, here it is: how it
# differs from this page's run, the conditions it ran under (measured engine choices, load),
# its curves with the sanity checks applied to its rows, and a threshold/policy control over it.

# %% tags=["results"]
# NBVAL_IGNORE_OUTPUT
import json

import pandas as pd
from IPython.display import display

from workbench.bench import sanity
from workbench.bench.concurrency import summarize
from workbench.viz import figures as F
from workbench.viz import prose as P
from workbench.viz.report import conditions_block, paired_ratio, results_dir, sanity_block

saved = results_dir() / "concurrency.csv"
saved_doc = (json.loads(saved.with_suffix(".json").read_text())
             if saved.with_suffix(".json").is_file() else {})
if saved.is_file():
    saved_rows = pd.read_csv(saved)
    saved_flags = sanity.sanity_flags(saved_rows, load=saved_doc.get("load"))
    saved_levels = sorted(int(c) for c in saved_rows.concurrency.unique())
    saved_repeats = int(saved_rows["repeat"].nunique()) if "repeat" in saved_rows else 1
    cfg = saved_doc.get("config", {})

    def more(a: int, b: int) -> str:
        return "more" if a > b else "fewer" if a < b else "as many"

    display(P.say(f"Saved run: {len(saved_levels)} levels (c = {', '.join(map(str, saved_levels))}), "
          f"{saved_repeats} repeat{'s' if saved_repeats != 1 else ''}, "
          f"{cfg.get('prompts', '?')} prompts × {cfg.get('max_new_tokens', '?')} new tokens; "
          f"this page's run: {len(LEVELS)} levels, {REPEATS} repeats — the saved run has "
          f"{more(len(saved_levels), len(LEVELS))} levels and "
          f"{more(saved_repeats, REPEATS)} repeats.",
          " With one repeat it has no intervals: none of its ratios is resolved at this noise."
          if saved_repeats < 2 else ""))
    display(conditions_block(saved_doc.get("engine_choices") or {},
                             f"the saved run {saved.name}", saved_doc.get("machine"),
                             saved_doc.get("load")))
    saved_table = summarize(saved_rows)
    saved_ratio = paired_ratio(saved_rows)
    fig = F.concurrency_curves(sanity.mark(saved_table.drop(columns=["flags"],
                                                            errors="ignore"), saved_flags),
                               ratio=saved_ratio)
    fig.update_layout(title=f"Saved run: {saved.name}")
    fig.show()
    display(sanity_block(saved_flags, f"the saved run {saved.name}"))
else:
    print(f"no saved results at {saved}: run "
          "`python -m workbench bench concurrency` to make one")

# %% [markdown]
# ### A threshold/policy control over the saved sweep
# Pick a policy: `BatchThreshold(n)` composed from the saved baseline and always-on arms
# (speculate at c ≤ n; switch costs not counted — an estimate, and the control says so), or any
# policy arm the sweep measured. The control re-reads the saved rows (no new run) and says what
# share of the envelope the policy reaches and, level by level, whether speculation is resolved
# to pay there. It opens on the `BatchThreshold` the saved run's own file suggests; in an
# exported page it is a snapshot, in a live kernel (`make lab`) it follows the controls.

# %% tags=["results"]
# NBVAL_IGNORE_OUTPUT
from workbench.viz.controls import ThresholdControl

if saved.is_file():
    policy_control = ThresholdControl(saved_table, saved_ratio, title="the saved run")
    suggested = (saved_doc.get("threshold") or {}).get("suggested_n")
    if suggested in policy_control.n.options:
        policy_control.select(n=suggested)
    display(policy_control)

# %% tags=["results"]
# NBVAL_IGNORE_OUTPUT
if saved.is_file():  # the control's selection, static (what an exported page shows)
    display(P.say(*policy_control.sentences()))
    display(policy_control.plot())

# %% [markdown]
# ## Recap
# Computed from this page's run:

# %%
# NBVAL_IGNORE_OUTPUT
P.say("• Always-on EAGLE-3 against the baseline, level by level: ", P.BR,
      *[x for cl in e3_claims.values() for x in ("  ", cl, P.BR)],
      "• Where the crossover lies, and whether this run can tell, is in the figures above: "
      "a band only where the intervals resolve one.", P.BR,
      "• `find_threshold` turns a sweep into `BatchThreshold(n)`; this page suggested "
      + ("one" if not (undecided or len(flagged_rows) or REPEATS < 2) else "none (the data "
         "were not consistent enough)")
      + ". Policies never change outputs (checked above, token for token).", P.BR,
      "• Latency is a distribution: the CDFs show the tails, with a p99 only where a run had "
      f"{F.MIN_P99_SAMPLES} samples.", P.BR,
      f"• Switching: {len(neg)} of {2 * len(costs)} measured switch costs were below 0 ms "
      "(noise). While off, a warm draft costs a little on every step, a cold one a catch-up "
      "per switch; `auto` takes the warm side for short off stretches.", P.BR,
      "• The threshold must exist before the first decode step that reads it: **05** shows "
      "the all-or-nothing init that makes a half-built engine impossible.")
