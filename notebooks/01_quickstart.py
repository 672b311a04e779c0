# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Quickstart: is EAGLE-3 faster than plain decoding here — and is it lossless?
#
# **You will learn** to load a target model with its EAGLE-3 draft head, generate with and
# without speculation, read the two numbers that matter (speedup and accept length τ), and check
# that speculation did not change a single output token.
#
# EAGLE-3 drafts several tokens with a one-layer head that reads the target's own hidden states,
# then the target verifies the whole draft tree in one forward pass. Greedy outputs must equal
# plain decoding exactly; the gain is fewer target forwards per token.

# %% tags=["parameters"]
import os

FAST = os.environ.get("WORKBENCH_FAST") == "1"  # CI: micro models and short runs
MAX_NEW_TOKENS = 32 if FAST else 64

# %% [markdown]
# ## Models and engine
# `page_models` picks the real pair — SmolLM2-135M-Instruct (`make real-model` fetches it) with
# its EAGLE-3 head `data/models/smollm2-eagle3` — when both are here and `FAST` is off; its
# prompts are held-out chat requests rendered with the model's own chat template. Without the
# real pair it takes the demo pair: the shipped `data/models/wb-target` + `data/models/wb-eagle3`,
# or under `FAST` a micro pair built once (about 40 s) and cached.

# %%
# NBVAL_IGNORE_OUTPUT
import workbench as wb
from workbench.viz import figures as F
from workbench.viz.pairs import page_models

models = page_models(fast=FAST)
engine = wb.Engine.from_pretrained(models.target, draft=models.draft, config=models.config)
prompts = models.prompts_for(engine)
cfg = engine.model_config
print(models.describe())
print(f"target: {cfg.num_hidden_layers} layers x {cfg.hidden_size}, vocab {cfg.vocab_size:,}; "
      f"{len(prompts)} prompts")

from workbench.viz.report import conditions_block

conditions_block(engine.choices, "this page's engine")

# %% [markdown]
# One prompt, decoded twice: plain (`spec=None`) and with an EAGLE-3 tree of S draft steps,
# top-K branching and N verified nodes (the values are printed below).

# %%
spec = wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
sampling = wb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
prompt = prompts[0]
plain = engine.generate([prompt], sampling)[0]
eagle = engine.generate([prompt], sampling, spec=spec)[0]
print(f"S = {spec.num_steps} draft steps, K = {spec.topk}, N = {spec.num_draft_tokens} nodes")

# %%
# NBVAL_CHECK_OUTPUT
assert eagle.token_ids == plain.token_ids, "speculation changed the output"
print("lossless (greedy, token for token):", eagle.token_ids == plain.token_ids)

# %% [markdown]
# Which tokens came from accepted drafts? Green tokens were proposed by the head and accepted
# by the target; blue ones the target produced itself (the bonus token of each verify step).

# %%
# NBVAL_IGNORE_OUTPUT
print(f"τ = {eagle.metrics.accept_length:.2f} tokens per verify step "
      f"over {eagle.metrics.verify_ct} verify steps")
F.colored_text(eagle.token_ids, eagle.from_draft, engine.tokenizer)

# %% [markdown]
# ## Speedup: baseline vs a chain and two trees, one run
# `run_spec_bench` interleaves the arms per prompt (they share the machine's noise), compares
# every speculative output with the baseline token for token, and reports tok/s, τ and the
# ratio to the baseline. The load average is sampled around the run: the sanity checks of
# `workbench.bench.sanity` flag a loaded machine and any speedup above τ (impossible without
# noise), and the interval is a 95 % interval over the per-prompt ratios (geometric mean,
# Student t on the log ratio: a ratio's interval stays above 0×).

# %%
# NBVAL_IGNORE_OUTPUT
import pandas as pd

from workbench.bench import sanity
from workbench.machine import format_machine, machine_info
from workbench.bench.spec import run_spec_bench
from workbench.viz.report import ratio_ci, sanity_block

with sanity.LoadSampler() as load:
    bench = run_spec_bench(engine, prompts, max_new_tokens=MAX_NEW_TOKENS,
                           progress=False)
per = bench.per_prompt.merge(bench.per_prompt[bench.per_prompt.arm == "baseline"][
    ["prompt", "tok_s"]].rename(columns={"tok_s": "base_tok_s"}), on="prompt")
per["speedup"] = per.tok_s / per.base_tok_s
# speedup = geometric mean of the per-prompt ratios, with its interval (n = prompts)
summary = bench.summary.drop(columns=["speedup"]).merge(ratio_ci(per, ["arm"], "speedup"),
                                                        on="arm")
# the engine's provisional choices (measured under contention) are a run-wide flag too
flags = sanity.sanity_flags(summary, load=load.as_dict()) + sanity.choice_flags(engine.choices)
summary = sanity.mark(summary, flags)
print(format_machine(machine_info()), "· float32 · greedy ·", len(prompts), "prompts ·",
      f"load {load.before[0]:.2f} → {load.after[0]:.2f}")
summary[["arm", "tok_s", "speedup", "speedup_lo", "speedup_hi", "tau", "lossless",
         "flags"]].round(3)

# %%
# NBVAL_IGNORE_OUTPUT
sanity_block(flags, "speedup and τ per arm")

# %%
# NBVAL_IGNORE_OUTPUT
F.speedup_bars(summary)

# %%
# NBVAL_CHECK_OUTPUT
print("every arm lossless:", bool(bench.summary["lossless"].all()))

# %% [markdown]
# What the table says, computed from it (not written in advance): each arm's claim takes its
# words from its interval, so an interval that straddles 1× reads "not resolved at this noise".

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.viz import prose as P

spec_rows = summary[summary.arm != "baseline"]
parts = []
for r in spec_rows.itertuples():
    parts += ["• ", P.ratio(r.arm, r.speedup, r.speedup_lo, r.speedup_hi, n=int(r.n)),
              f" at τ = {r.tau:.2f}" + (f" ⚠ {r.flags}" if r.flags else ""), P.BR]
codes = sorted({c for f in spec_rows["flags"] for c in f.split(",") if c})
n_flagged = int((spec_rows["flags"] != "").sum())
P.say(*parts, f"{n_flagged} of {len(spec_rows)} arms carry sanity flags"
      + (f" ({', '.join(codes)}): read their ratios as noisy." if n_flagged else "."))

# %% [markdown]
# τ is not a constant: each verify step accepts between 0 and S draft tokens, plus the bonus.

# %%
# NBVAL_IGNORE_OUTPUT
with wb.trace(engine) as tr:
    engine.generate(prompts, sampling, spec=spec)
F.tau_histogram(tr.frame("verify"))

# %% [markdown]
# ## Where a step's time goes
# The same traced run (every prompt decoded together, one batch), step by step: a speculative
# step drafts (S head forwards), verifies the N-node tree in one target forward, accepts
# (compares draft and target tokens), commits (keeps the accepted KV) and extends the draft.
# Averages first, then the first steps one by one.

# %%
# NBVAL_IGNORE_OUTPUT
timing = tr.frame("timing")
F.phase_breakdown(timing)

# %%
# NBVAL_IGNORE_OUTPUT
F.phase_timeline(timing[timing.step < timing.step.min() + 40])

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.trace.frame import TIMING_PHASES

spec_steps = timing[timing["mode"] == "spec"]
# every phase the engine timed, extend and schedule included: the shares add up to 100 %
shares = {p: spec_steps[f"{p}_ms"].sum() / spec_steps.total_ms.sum() for p in TIMING_PHASES
          if spec_steps[f"{p}_ms"].sum() > 0}
verify_steps = tr.frame("verify")
per_step = verify_steps.groupby("step").agg(requests=("rid", "nunique"),
                                            tokens=("accept_length", "sum"))
P.say("Share of a speculative step's time (", f"{len(spec_steps)} steps, all phases): ",
      ", ".join(f"{p} {v:.0%}" for p, v in shares.items()),
      f" (sum {sum(shares.values()):.0%}).", P.BR,
      f"This run decoded {len(prompts)} prompts together: a speculative step served "
      f"{per_step.requests.mean():.1f} requests on average, took "
      f"{spec_steps.total_ms.mean():.1f} ms and emitted {per_step.tokens.mean():.1f} tokens "
      f"in all — τ = {verify_steps.accept_length.mean():.2f} tokens per request per step.")

# %% [markdown]
# ## Recap
# - `wb.Engine.from_pretrained(target, draft=head)`, then `generate(..., spec=wb.SpecConfig(...))`;
#   `spec=None` is the baseline on the same engine.
# - τ (tokens per verify step, bonus included) says how much each target forward buys; the
#   speedup also depends on what a draft step and an N-token verify cost on this machine — the
#   time breakdown above shows both. The numbers on this page are this run's: the stamp at the
#   top names the machine and its load, and the sanity block says whether to trust them.
# - Greedy speculative outputs equal the baseline's: checked above for every arm.
#
# Next: **02_draft_trees** opens one verify step and shows the tree the head drafted.
