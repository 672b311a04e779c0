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
# crossover and turn it into a `BatchThreshold`, what the draft costs while speculation is off
# (warm vs cold draft state), and how the policies compare on goodput (output tokens/s).
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
LEVELS = (1, 2, 4, 8) if FAST else (1, 2, 4, 8, 16)
MAX_NEW_TOKENS = 16 if FAST else 48
THRESHOLD_GUESS = 2 if FAST else 8

# %%
# NBVAL_IGNORE_OUTPUT
import pandas as pd

import workbench as wb
from workbench.bench.concurrency import (
    default_arms,
    find_threshold,
    run_concurrency,
    summarize,
    switch_costs,
)
from workbench.bench.machine import machine_info
from workbench.viz import figures as F
from workbench.viz.demo_models import REPO_ROOT, demo_models
from workbench.viz.widgets import SweepProgress

models = demo_models(fast=FAST)
engine = wb.Engine.from_pretrained(models.target, draft=models.draft,
                                   config=wb.EngineConfig(max_batch_size=max(LEVELS)))
prompts = list(models.prompts)
print(models.describe())

# %% [markdown]
# ## The arms
# One engine, one draft head, several policies. The seeds ran a chain (`topk=1`); so do we.
# `default_arms` also calibrates a cost model for the goodput policy on this machine.

# %%
spec = wb.SpecConfig(num_steps=4, topk=1)
arms = default_arms(engine, spec=spec, threshold=THRESHOLD_GUESS)

# %%
# NBVAL_CHECK_OUTPUT
for name, s in arms.items():
    print(f"{name:10s}", "baseline (no draft)" if s is None else
          f"{type(s.policy).__name__}, draft {s.draft_state}")

# %% [markdown]
# ## The sweep
# Closed loop: at concurrency c, c requests stay in flight (a new one joins when one finishes).
# Every arm gets its own engine and the arms of a level advance **one step each per round**,
# each timed on its own clock: they share the same stretch of the machine's life, so its drift
# (±10 % over minutes on a busy laptop) cancels from the ratios. Progress and tok/s update live,
# one point per arm.

# %%
cfg = wb.EngineConfig(max_batch_size=max(LEVELS), kv_budget_tokens=8192)
engines = {a: wb.Engine.from_pretrained(models.target, draft=models.draft, config=cfg)
           for a in arms}

# %%
# NBVAL_IGNORE_OUTPUT
progress = SweepProgress(len(LEVELS) * len(arms), "concurrency sweep", x="concurrency",
                         y="tok_s", color="arm")
progress

# %%
frames = []
for i, c in enumerate(progress.iter(LEVELS)):
    df = run_concurrency(engine, prompts, levels=[c], arms=arms, max_new_tokens=MAX_NEW_TOKENS,
                         warmup=i == 0, progress=False, engines=engines)
    for row in df.itertuples():
        progress.update(arm=row.arm, concurrency=c, tok_s=row.tok_s)
    frames.append(df)
results = pd.concat(frames, ignore_index=True)
summary = summarize(results)

# %%
# NBVAL_CHECK_OUTPUT
print("every arm matches the baseline token for token:", bool(summary.lossless.dropna().all()))

# %%
# NBVAL_IGNORE_OUTPUT
print({k: machine_info()[k] for k in ("cpu", "cores", "torch_threads", "cuda")},
      f"· greedy · {len(prompts)} prompts · {MAX_NEW_TOKENS} new tokens")
summary[["arm", "concurrency", "tok_s", "vs_baseline", "itl_p50_ms", "ttft_p50_ms", "tau",
         "spec_share"]].round(2)

# %% [markdown]
# ## The envelope
# Throughput (left) and inter-token latency (right) against concurrency. The dashed line marks
# where always-on EAGLE-3 falls below the baseline, if it does inside the range.

# %%
# NBVAL_IGNORE_OUTPUT
F.concurrency_curves(summary[summary.arm.isin(["baseline", "eagle3", "threshold", "goodput"])])

# %% [markdown]
# ## Choosing the threshold
# `find_threshold` takes the smallest level where the baseline is at least as fast as
# EAGLE-3, and suggests the largest level below it as `BatchThreshold(n)` (0: never speculate).

# %%
# NBVAL_IGNORE_OUTPUT
th = find_threshold(results)
print(f"crossover: {th.crossover} · suggested BatchThreshold({th.suggested_n})")
th.table.round(2)

# %% [markdown]
# Check it: with that threshold the engine should ride the upper envelope of the two curves.
# While speculation is off, the draft state matters: **warm** keeps the draft's KV current with
# a draft extend on every plain step; **cold** skips it and catches up when speculation
# returns. With a low threshold the draft is off most of the time, so cold should be cheaper.

# %%
import dataclasses

chosen = {"baseline": None, "eagle3": arms["eagle3"]}
for state in ("warm", "cold"):
    chosen[f"threshold {th.suggested_n} {state}"] = dataclasses.replace(
        spec, policy=wb.BatchThreshold(th.suggested_n), draft_state=state)
# each arm of this check borrows one of the sweep's engines (one arm per engine)
lent = dict(zip(chosen, ["baseline", "eagle3", "threshold", "goodput"], strict=True))
check = summarize(run_concurrency(engine, prompts, levels=LEVELS, arms=chosen,
                                  max_new_tokens=MAX_NEW_TOKENS, progress=False,
                                  engines={a: engines[e] for a, e in lent.items()}))

# %%
# NBVAL_IGNORE_OUTPUT
F.concurrency_curves(check)

# %% [markdown]
# ## What a switch costs
# The `flip_warm` / `flip_cold` arms turn speculation on and off at random (p = 0.5) so every
# step is a potential switch. Cold pays when speculation comes back (draft catch-up); warm pays
# on every plain step. The policy arms (`never`, `threshold`, `goodput`) use
# `draft_state="auto"`: warm for the first 8 plain steps of an off stretch (short flips stay
# cheap), cold after that. The `never` arm measures what an idle speculative engine still
# costs — the **K=0 tax**.

# %%
# NBVAL_IGNORE_OUTPUT
F.warm_vs_cold(switch_costs(results))

# %%
# NBVAL_IGNORE_OUTPUT
summary[summary.arm == "never"][["concurrency", "tok_s", "k0_tax"]].round(3)

# %% [markdown]
# ## Watching a policy decide
# Six requests of different lengths under `BatchThreshold(2)`: the engine decodes plainly while
# more than two requests run, then speculates as they finish.

# %%
# NBVAL_IGNORE_OUTPUT
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
# more levels and repeats; or the GPU box through `--url`). If one exists, here it is:

# %%
# NBVAL_IGNORE_OUTPUT
saved = REPO_ROOT / "data" / "results" / "concurrency.csv"
if saved.is_file():
    fig = F.concurrency_curves(summarize(pd.read_csv(saved)))
    fig.update_layout(title=f"Saved run: {saved.relative_to(REPO_ROOT)}")
    fig.show()
else:
    print(f"no saved results at {saved.relative_to(REPO_ROOT)}: run "
          "`python -m workbench bench concurrency` to make one")

# %% [markdown]
# ## Recap
# - Speculation trades compute for latency: it pays while the batch leaves the hardware idle and
#   costs throughput once verify work competes with other requests. On the micro models on a CPU
#   the per-step overheads make it lose even at batch 1 (suggested threshold 0); the shipped
#   models win at batch 1 on the same CPU; on the seeds' GPU box EAGLE-3 won single-stream and
#   the baseline was ahead at every parallel level they measured.
# - `find_threshold` turns a sweep into `BatchThreshold(n)`; the threshold arm should track the
#   upper envelope. Policies never change outputs (checked above, token for token).
# - While off, a warm draft costs a little on every step, a cold one a catch-up per switch;
#   `auto` takes the warm side for short off stretches and the cold side for long ones.
# - The threshold must exist before the first decode step that reads it: **05** shows the
#   all-or-nothing init that makes a half-built engine impossible.
