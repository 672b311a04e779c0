# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · Policy lab: score any speculation policy on one recorded run
#
# **You will learn** how one recorded run answers *every* speculation policy at *every*
# concurrency without another target forward, how SGLang's adaptive controller (its own code,
# from the installed wheel) and vLLM's dynamic table compare with ours on the same data, how far
# each is from a hindsight oracle, whether the replay agrees with a real run, and how the winner
# becomes an SGLang tier file for the box.
#
# **Why it works.** For greedy decoding the output does not depend on the policy, so the
# accepted length of any tree at any position is the longest tree path matching the recorded
# continuation, +1. The recording keeps, at every output position, the candidates the head
# proposes there (for every top-k up to the recorded one), so every smaller shape's tree is
# rebuilt exactly as the engine builds it. Step *times* are modelled; docs/LAB.md says what is
# exact and what is modelled.

# %% tags=["parameters"]
import os

FAST = os.environ.get("WORKBENCH_FAST") == "1"
SHAPE = (4, 2, 8) if FAST else (5, 4, 16)  # the recorded (largest) shape
MAX_NEW_TOKENS = 24 if FAST else 48
LEVELS = (1, 2, 4, 8, 16, 32, 64)  # replayed: cheap at any level
REAL_LEVELS = (1, 4)  # the real-run check: every arm for real at these levels
REAL_REPEATS = 1 if FAST else 3  # repeats of the real run: an interval needs two or more
POLICIES = "always,threshold:auto,goodput,sglang,vllm"

# %%
# NBVAL_IGNORE_OUTPUT
import dataclasses
import tempfile
import time
from pathlib import Path

import plotly.graph_objects as go

import workbench as wb
from workbench.bench import sanity
from workbench.bench.concurrency import run_concurrency
from workbench.engine.calibrate import measure_tau
from workbench.lab.arms import ArmInputs, make_policy, split_policies
from workbench.lab.boxreplay import check_tiers, compile_tiers, initial_steps
from workbench.lab.record import record
from workbench.errors import ConfigError
from workbench.lab.replay import oracle_is_bound, replay, winner
from workbench.lab.stepfit import fit_step_model
from workbench.lab.trees import bs1_accept_lengths
from workbench.lab.validate import against, sign_test, sign_text
from workbench.machine import format_machine, loadavg, machine_info
from workbench.train.demo_models import demo_models
from workbench.viz import figures as F
from workbench.viz.figures.style import dress
from workbench.viz import prose as P
from workbench.viz.report import sanity_block

models = demo_models(fast=FAST)
engine = wb.Engine.from_pretrained(models.target, draft=models.draft,
                                   config=wb.EngineConfig(max_batch_size=64, draft_dtype="same"))
prompts = list(models.prompts)
print(models.describe())
print(format_machine(machine_info()), "· load", loadavg())

# %% [markdown]
# ## Record once
# The step-time model is measured first: forward costs on scratch KV, then whole steps of
# closed loops on these prompts at c = 1, 4, 16 (`never`, and `always` at three shapes), one
# after another on this engine as the real-run check below runs its arms (`lab record` gives
# every arm its own engine and interleaves them, as `bench concurrency` does). Then every
# prompt is decoded once with a warm draft while the engine's own drafter proposes, at each
# position, one tree per top-k with every candidate kept.

# %%
# NBVAL_IGNORE_OUTPUT
t0 = time.perf_counter()
cost = fit_step_model(engine, prompts, SHAPE, tokens=16 if FAST else 32)  # anchored steps
run = record(engine, prompts, SHAPE, MAX_NEW_TOKENS, cost_model=cost)
record_s = time.perf_counter() - t0
walk = [e for r in bs1_accept_lengths(run, SHAPE) for e in r]
P.say(f"Recorded {len(prompts)} prompts × {MAX_NEW_TOKENS} tokens: {len(run.req)} positions, "
      f"top-k 1..{SHAPE[1]}, chains to {run.chain_steps} steps, in {record_s:.1f} s "
      f"(step model included). Replayed alone at S{SHAPE[0]}K{SHAPE[1]}N{SHAPE[2]}, "
      f"τ = {sum(walk) / len(walk):.2f} over {len(walk)} verify steps.")

# %%
# NBVAL_CHECK_OUTPUT
print("outputs:", [len(o) for o in run.outputs], "· tree rows:", len(run.req),
      "· top-k recorded:", sorted(run.trees))

# %% [markdown]
# ## Replay every arm at c = 1 … 64
# `never` (the ratio's base) and the hindsight `oracle` (per step, the shape or off that
# emits the most tokens per modelled ms given the acceptance that actually happens) always
# run. `sglang` is `AdaptiveSpeculativeParams` from the sglang 0.5.23 wheel with its default
# tiers, deciding chains; `vllm` is the docs' EAGLE-3 table (1–16 → 5, 17–32 → 4, 33–64 → 3,
# 65–128 → 1, then 0).

# %%
# NBVAL_IGNORE_OUTPUT
t0 = time.perf_counter()
df, results = replay(run, POLICIES, list(LEVELS))
replay_s = time.perf_counter() - t0
cols = ["policy", "concurrency", "tok_s", "vs_never", "tau", "spec_fraction", "tpot_n",
        "tpot_p50_ms", "tpot_p99_ms", "regret"]  # no p99 from fewer than 100 requests
df[cols].round(3)

# %%
# NBVAL_CHECK_OUTPUT
print(sorted(set(df["policy"])), sorted(set(df["concurrency"])))
lowest = df.groupby("concurrency").regret.min()  # the bound arm: the oracle, or what beat it
print("every level's bound at regret 0, none below:",
      bool((lowest.abs() < 1e-9).all() and (df.regret >= -1e-9).all()))

# %%
# NBVAL_IGNORE_OUTPUT
fig = go.Figure()
env = df[df.policy == "oracle"].sort_values("concurrency")
bounded = oracle_is_bound(df)  # "bound" only where no replayed arm beat the per-step oracle
beaten = sorted({(b, int(c)) for b, c in zip(df.bound, df.concurrency, strict=True)
                 if b != "oracle"})
fig.add_trace(go.Scatter(x=env.concurrency, y=env.tok_s,
                         name="oracle (hindsight bound)" if bounded else
                         "oracle (per-step hindsight; not a bound here)",
                         mode="lines", line=dict(color="#bbbbbb", width=0),
                         fill="tozeroy", fillcolor="rgba(200,200,200,0.35)"))
for i, name in enumerate(p for p in dict.fromkeys(df.policy) if p != "oracle"):
    d = df[df.policy == name].sort_values("concurrency")
    st = F.arm_style(name, i)
    fig.add_trace(go.Scatter(x=d.concurrency, y=d.tok_s, name=name, mode="lines+markers",
                             line=dict(color=st["color"], width=st["width"], dash=st["dash"])))
fig.update_xaxes(type="log", tickvals=list(LEVELS), title="concurrency (requests in flight)")
fig.update_yaxes(title="output tok/s (replayed)")
dress(fig, "tokens/s vs concurrency per policy, under the hindsight oracle's envelope"
      if bounded else "tokens/s vs concurrency per policy beside the per-step oracle, which "
      + ", ".join(f"{b} beats at c = {c}" for b, c in beaten), 900, 420)

# %%
# NBVAL_IGNORE_OUTPUT
regret = df[~df.policy.isin(["oracle"])].pivot(index="policy", columns="concurrency",
                                               values="regret")
regret["mean"] = regret.mean(axis=1)
try:
    best, verdict_text = winner(df), None
except ConfigError as e:  # inside the replay's error no arm wins: said, and no tier file
    best, verdict_text = None, str(e)
bound_word = "the bound (the per-step oracle, or an arm that beat it)"
lead = (f"**{best}** ({regret.loc[best, 'mean']:.1%})" if best else
        f"no winner — {verdict_text.removeprefix('no winner: ')}")
P.say(f"Regret = 1 − tok/s ÷ {bound_word}. Least mean regret over c = {LEVELS[0]}…"
      f"{LEVELS[-1]}: {lead}. SGLang's controller: {regret.loc['sglang', 'mean']:.1%}, "
      f"vLLM's table: {regret.loc['vllm', 'mean']:.1%}, `never`: "
      f"{regret.loc['never', 'mean']:.1%}; an arm wins only when its interval (± the "
      f"replay's 10 %) clears the runner-up's. The whole replay took {replay_s:.1f} s.")

# %%
# NBVAL_IGNORE_OUTPUT
regret.style.format("{:.1%}")

# %% [markdown]
# ## The real-run check beside the prediction
# The same policies, built the same way (`lab.arms`), run for real on this engine beside
# `baseline` and `never` (`bench concurrency --policy ... --prompts-file ...` does this from
# the command line), at two levels. The replay predicts each policy's tok/s over `never`'s.

# %%
# NBVAL_IGNORE_OUTPUT
acc = measure_tau(engine, prompts, SHAPE, max_new_tokens=MAX_NEW_TOKENS)
inputs = ArmInputs(SHAPE, cost, acc, engine.config.max_batch_size)
base = wb.SpecConfig(*SHAPE, draft_state="auto")
real_arms = {"baseline": None}
for name in ["never", *split_policies(POLICIES)]:
    real_arms[name] = dataclasses.replace(base, policy=make_policy(name, inputs))
load_before = loadavg()
with sanity.LoadSampler() as real_load:
    measured = run_concurrency(engine, prompts, levels=REAL_LEVELS, arms=real_arms,
                               max_new_tokens=MAX_NEW_TOKENS, repeats=REAL_REPEATS,
                               progress=False)
load_after = loadavg()
# the real run measures tok/s: the sanity checks of every speed page, with the engine's
# provisional choices folded in
real_flags = (sanity.sanity_flags(measured, load=real_load.as_dict())
              + sanity.choice_flags(engine.choices))
check = against(df[df.concurrency.isin(REAL_LEVELS)], measured)
check = check[~check.policy.isin(["never", "oracle"])]
sign = sign_test(check)
check[["policy", "concurrency", "vs_never", "measured_vs_never", "measured_n", "ratio_error",
       "error_lo", "error_hi", "within_10pct"]].round(3)

# %%
# NBVAL_IGNORE_OUTPUT
sanity_block(real_flags, "the real run beside the replay")

# %%
# NBVAL_CHECK_OUTPUT
print("real outputs equal the baseline's for every policy:",
      bool(measured.lossless.dropna().all()))

# %%
# NBVAL_IGNORE_OUTPUT
ok = int(check.within_10pct.sum())
err = check.ratio_error.abs()
worst = check.loc[err.idxmax()]
n_rep = int(check.measured_n.min())
P.say(f"The replayed ratio is within ±10 % of the measured one in {ok} of {len(check)} cells "
      f"(largest miss {worst.ratio_error:+.1%}, {worst.policy} at c = "
      f"{int(worst.concurrency)}); {sign_text(sign)}. "
      + (f"Each measured ratio is the mean of {n_rep} repeats with its 95 % interval; the "
         f"error's interval is the replayed ratio over its ends. " if n_rep > 1 else
         "One real repeat per cell: the measured ratios carry no interval, so neither do the "
         "errors. ")
      + f"The arms ran back to back on one engine, load "
      f"{load_before[0] if load_before else 'n/a'} → {load_after[0] if load_after else 'n/a'} "
      f"on {os.cpu_count()} cores. Greedy acceptance is exact; the misses are step times.")

# %%
# NBVAL_IGNORE_OUTPUT
# one checked claim per cell: the replayed ratio over the measured one, with the interval the
# measured repeats give (none from one repeat: then "not resolved", never a side)
cell_claims = []
for r in check.itertuples():
    cell_claims += ["• ", P.ratio(f"the replay of {r.policy} at c = {int(r.concurrency)}",
                                  1.0 + r.ratio_error, 1.0 + r.error_lo, 1.0 + r.error_hi,
                                  n=int(r.measured_n), above="overshoots",
                                  below="undershoots", against="the measured ratio"), P.BR]
P.say(*cell_claims)

# %% [markdown]
# ## The winner as an SGLang 0.5.23 tier file
# Only when the replay names a winner outside its error. Per batch size, the chain steps the
# policy ran (a candidate list where it varied; trees run as chains upstream), written as
# `--speculative-adaptive-config` and routed through SGLang's own `AdaptiveSpeculativeParams`
# at every batch size up to 64. On the box the same replay
# runs from `bench threshold --url` sweeps and request records (`lab fit-box`).

# %%
# NBVAL_IGNORE_OUTPUT
routes, notes = None, []
if best is None:
    print(f"no tier file: {verdict_text}")
else:
    steps = [st for (p, _), res in results.items() if p == best for st in res.steps]
    tiers, notes = compile_tiers(steps, LEVELS[-1])
    tier_file = Path(tempfile.mkdtemp()) / "tiers.json"
    print(f"winner: {best}")
    if any(st > 0 for _, cands in tiers.tiers for st in cands):
        routes = check_tiers(tiers, tier_file, LEVELS[-1])
        print(tiers.config_text(), end="")
        print(f"--speculative-adaptive --speculative-adaptive-config {tier_file.name} "
              f"--speculative-num-steps {initial_steps(tiers)} --speculative-eagle-topk 1")
    else:
        print("it never speculated at any batch size here: launch the box without speculation")
for n in notes:
    print("note:", n)

# %%
# NBVAL_CHECK_OUTPUT
print("SGLang's router agrees at every batch size (or nothing to route):",
      routes is None or len(routes) == LEVELS[-1])

# %%
engine.close()
