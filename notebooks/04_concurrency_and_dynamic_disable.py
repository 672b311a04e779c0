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
from workbench.viz.report import highlight_flagged, ratio_ci, sanity_block
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
# The table: means over the repeats, the tok/s interval (95 %, over repeats, log scale), and
# the sanity flags of each row (amber rows failed a check; the block below says which and why).

# %%
# NBVAL_IGNORE_OUTPUT
flags = sanity.sanity_flags(results, load=load.as_dict())
# tok/s interval on the log scale (geometric, stays above 0 tok/s), replacing any other
tok_ci = ratio_ci(results, ["arm", "concurrency"], "tok_s").drop(columns=["tok_s", "n"])
summary = summary.drop(columns=[c for c in ("tok_s_lo", "tok_s_hi") if c in summary])
table = sanity.mark(summary.merge(tok_ci, on=["arm", "concurrency"]), flags)
print(format_machine(machine_info()),
      f"· greedy · {len(prompts)} prompts · {MAX_NEW_TOKENS} new tokens · {REPEATS} repeats · "
      f"load {load.before[0]:.2f} → {load.after[0]:.2f}")
shown = table[table.arm.isin(["baseline", "eagle3", "never", "threshold", "goodput"])]
highlight_flagged(shown[["arm", "concurrency", "tok_s", "tok_s_lo", "tok_s_hi", "vs_baseline",
                         "itl_p50_ms", "ttft_p50_ms", "tau", "spec_share", "flags"]])

# %%
# NBVAL_IGNORE_OUTPUT
sanity_block(flags, "the concurrency sweep")

# %% [markdown]
# ## The envelope
# Throughput, inter-token latency and time to first token against concurrency, each on its own
# axis (latencies on a log scale). The dashed line marks where always-on EAGLE-3 falls below the
# baseline, if it does inside the range.

# %%
# NBVAL_IGNORE_OUTPUT
F.concurrency_curves(table[table.arm.isin(["baseline", "eagle3", "never", "threshold",
                                           "goodput"])])

# %% [markdown]
# ## Speedup vs batch size, with intervals
# Per repeat, each arm's tok/s over the baseline's *in the same interleaved run*; points are
# the geometric mean over the repeats and the bars its 95 % interval. An interval that straddles 1.0 means this run cannot tell
# the arm from the baseline at that level.

# %%
# NBVAL_IGNORE_OUTPUT
base = results[results.arm == "baseline"][["concurrency", "repeat", "tok_s"]]
paired = results.merge(base.rename(columns={"tok_s": "base_tok_s"}),
                       on=["concurrency", "repeat"])
paired["ratio"] = paired.tok_s / paired.base_tok_s
ratio = ratio_ci(paired[paired.arm != "baseline"], ["arm", "concurrency"], "ratio")
ratio = ratio.merge(table[["arm", "concurrency", "flags"]], on=["arm", "concurrency"])
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
undecided = [int(c) for c, r in e3.iterrows() if r.ratio_lo <= 1.0 <= r.ratio_hi]
flagged_rows = table[table.arm.isin(["baseline", "eagle3"]) & (table["flags"] != "")]
print(th.table.round(2).to_string(index=False))
if undecided or len(flagged_rows) or REPEATS < 2:
    why = []
    if undecided:
        why.append(f"EAGLE-3 vs baseline undecided (interval contains 1.0) at c = {undecided}")
    if len(flagged_rows):
        why.append("sanity flags on " + ", ".join(
            f"{r.arm}@c={r.concurrency}: {r.flags}" for r in flagged_rows.itertuples()))
    print("\nno threshold suggested — the data are not consistent enough:\n  " +
          "\n  ".join(why))
else:
    print(f"\ncrossover: {th.crossover} · suggested BatchThreshold({th.suggested_n}) "
          f"(every interval on one side of 1.0, no flags)")

# %% [markdown]
# How close did the threshold arm (the measured `BatchThreshold(n)` above, `draft_state=auto`)
# come to the upper envelope, the better of baseline and always-on EAGLE-3 at each level?
# Computed, not assumed:

# %%
# NBVAL_IGNORE_OUTPUT
env = summary.pivot(index="concurrency", columns="arm", values="tok_s")
env["envelope"] = env[["baseline", "eagle3"]].max(axis=1)
env["threshold ÷ envelope"] = env["threshold"] / env["envelope"]
env["goodput ÷ envelope"] = env["goodput"] / env["envelope"]
print(env[["baseline", "eagle3", "threshold", "goodput", "envelope", "threshold ÷ envelope",
           "goodput ÷ envelope"]].round(3).to_string())
lo_t, hi_t = env["threshold ÷ envelope"].min(), env["threshold ÷ envelope"].max()
print(f"\nthe threshold arm reached {lo_t:.0%}–{hi_t:.0%} of the envelope across levels "
      f"({'on it within 5 %' if lo_t >= 0.95 else 'below it at some level'}); goodput "
      f"{env['goodput ÷ envelope'].min():.0%}–{env['goodput ÷ envelope'].max():.0%}")

# %% [markdown]
# ## Latency distributions
# Percentiles hide the shape. Every TTFT, time per output token (TPOT) and inter-token gap (ITL)
# of a closed-loop run at the lowest and the highest level, baseline vs always-on EAGLE-3, on
# log axes (a queued first token and a plain step differ by orders of magnitude). A speculative
# step emits several tokens at once: its ITL gaps are fewer and longer.

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.viz.latency import latency_samples

lat = latency_samples(engines["baseline"], prompts, {"baseline": None, "eagle3": arms["eagle3"]},
                      levels=[LEVELS[0], LEVELS[-1]], max_new_tokens=MAX_NEW_TOKENS)
pct = lat.groupby(["arm", "concurrency", "metric"]).ms.quantile([0.5, 0.99]).unstack()
pct.columns = ["p50 ms", "p99 ms"]
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
# run at two levels, once each (they measure a per-step cost, not a throughput ratio).

# %%
# NBVAL_IGNORE_OUTPUT
flips = run_concurrency(engine, prompts, levels=FLIP_LEVELS, arms=flip_arms,
                        max_new_tokens=MAX_NEW_TOKENS, progress=False,
                        engines=engines)
print("flip arms lossless:", bool(summarize(flips).lossless.dropna().all()))
F.warm_vs_cold(switch_costs(flips))

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
# `python -m workbench bench concurrency` writes `data/results/concurrency.csv` (shipped models,
# more levels and repeats; or the GPU box through `--url`). If one exists, here it is, with the
# sanity checks applied to its rows (its own load record is in the JSON beside it):

# %%
# NBVAL_IGNORE_OUTPUT
from IPython.display import display

saved = REPO_ROOT / "data" / "results" / "concurrency.csv"
if saved.is_file():
    saved_rows = pd.read_csv(saved)
    saved_flags = sanity.sanity_flags(saved_rows)
    fig = F.concurrency_curves(summarize(saved_rows))
    fig.update_layout(title=f"Saved run: {saved.relative_to(REPO_ROOT)}")
    fig.show()
    display(sanity_block(saved_flags, f"the saved run {saved.name}"))
else:
    print(f"no saved results at {saved.relative_to(REPO_ROOT)}: run "
          "`python -m workbench bench concurrency` to make one")

# %% [markdown]
# ## Recap
# - Speculation trades compute for latency: it pays while the batch leaves the hardware idle and
#   costs throughput once verify work competes with other requests. Where the crossover lies on
#   this machine, and whether this run can tell, is computed above — with intervals over the
#   repeats and the sanity flags of every row.
# - `find_threshold` turns a sweep into `BatchThreshold(n)`; the page only suggests one when
#   every level's interval is on one side of 1.0 and no row is flagged. Policies never change
#   outputs (checked above, token for token).
# - Latency is a distribution: the CDFs show the p99 tails that the p50 table hides.
# - While off, a warm draft costs a little on every step, a cold one a catch-up per switch;
#   `auto` takes the warm side for short off stretches and the cold side for long ones.
# - The threshold must exist before the first decode step that reads it: **05** shows the
#   all-or-nothing init that makes a half-built engine impossible.
