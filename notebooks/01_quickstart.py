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
MAX_NEW_TOKENS = 32 if FAST else 128

# %% [markdown]
# ## Models and engine
# `demo_models` picks the shipped pair (`data/models/wb-target` + `data/models/wb-eagle3`) when
# it exists and `FAST` is off; otherwise it builds a micro pair once (about 40 s) and caches it.

# %%
# NBVAL_IGNORE_OUTPUT
import workbench as wb
from workbench.viz import figures as F
from workbench.viz.demo_models import demo_models

models = demo_models(fast=FAST)
engine = wb.Engine.from_pretrained(models.target, draft=models.draft)
print(models.describe())

# %% [markdown]
# One prompt, decoded twice: plain (`spec=None`) and with an EAGLE-3 tree of S=5 draft steps,
# top-K=4 branching and N=16 verified nodes.

# %%
spec = wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
sampling = wb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
prompt = models.prompts[0]
plain = engine.generate([prompt], sampling)[0]
eagle = engine.generate([prompt], sampling, spec=spec)[0]

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
# ratio to the baseline.

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.bench.machine import machine_info
from workbench.bench.spec import run_spec_bench

bench = run_spec_bench(engine, list(models.prompts), max_new_tokens=MAX_NEW_TOKENS)
print({k: machine_info()[k] for k in ("cpu", "cores", "torch_threads", "torch", "cuda")},
      "· float32 · greedy ·", len(models.prompts), "prompts")
bench.summary.round(3)

# %%
# NBVAL_IGNORE_OUTPUT
F.speedup_bars(bench.summary)

# %%
# NBVAL_CHECK_OUTPUT
print("every arm lossless:", bool(bench.summary["lossless"].all()))

# %% [markdown]
# τ is not a constant: each verify step accepts between 0 and S draft tokens, plus the bonus.

# %%
# NBVAL_IGNORE_OUTPUT
with wb.trace(engine) as tr:
    engine.generate(list(models.prompts), sampling, spec=spec)
F.tau_histogram(tr.frame("verify"))

# %% [markdown]
# ## Recap
# - `wb.Engine.from_pretrained(target, draft=head)`, then `generate(..., spec=wb.SpecConfig(...))`;
#   `spec=None` is the baseline on the same engine.
# - τ (tokens per verify step, bonus included) says how much each target forward buys; the
#   speedup also depends on what a draft step and an N-token verify cost on this machine. On the
#   micro models (CPU, tiny widths) per-step overheads dominate and speculation can lose; the
#   shipped models and GPUs are where τ turns into speed.
# - Greedy speculative outputs equal the baseline's: checked above for every arm.
#
# Next: **02_draft_trees** opens one verify step and shows the tree the head drafted.
