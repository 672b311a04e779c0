# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Draft trees: what does the head propose, and which branch does the target accept?
#
# **You will learn** how one EAGLE-3 verify step looks from the inside: the dynamic draft tree
# (S steps deep, top-K wide, N nodes kept), the path the target accepts, the bonus token — and
# how to step through generation yourself with the `Explorer` widget.

# %% tags=["parameters"]
import os

FAST = os.environ.get("WORKBENCH_FAST") == "1"
MAX_NEW_TOKENS = 32 if FAST else 96

# %%
# NBVAL_IGNORE_OUTPUT
import workbench as wb
from workbench.viz import figures as F
from workbench.train.demo_models import demo_models

models = demo_models(fast=FAST)
engine = wb.Engine.from_pretrained(models.target, draft=models.draft)
print(models.describe())

# %% [markdown]
# ## The tree, as the engine traced it
# Depth 0 is the **root**: the last verified token. Depth 1 holds the head's top-K guesses; each
# later step expands the K best frontier nodes into K children each and keeps the best K by
# cumulative log-probability. After S steps the N−1 best nodes overall (parents before children)
# plus the root are verified in **one** target forward with a tree attention mask.

# %%
spec = wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
with wb.trace(engine) as tr:
    out = engine.generate([models.prompts[1]], wb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
                          spec=spec)[0]
tree, verify = tr.frame("tree"), tr.frame("verify")

# %%
# NBVAL_IGNORE_OUTPUT
tree[tree.step == verify.step.iloc[0]][
    ["node", "token", "parent", "depth", "draft_prob", "accepted", "target_prob"]]

# %% [markdown]
# Invariants of every tree in the trace (the facts the verify kernel relies on):

# %%
# NBVAL_CHECK_OUTPUT
per_tree = tree.groupby(["step", "rid"])
print("nodes per tree:", sorted(per_tree.size().unique().tolist()))
print("parents precede children:", bool((tree.parent < tree.node).all()))
print("root accepted in every tree:", bool(tree[tree.node == 0].accepted.all()))
print("τ == accepted nodes per tree, root included (it stands for the bonus):",
      bool((per_tree.accepted.sum().values == verify.accept_length.values).all()))

# %% [markdown]
# The best step of this request: the highlighted path is what the target accepted; the dashed
# diamond is the **bonus** token the target produces after the last accepted node (drawn one
# depth further, on a row of its own below the drafted nodes). Hover a node for its draft and
# target probabilities.

# %%
# NBVAL_IGNORE_OUTPUT
step, rid = F.pick_tree(verify, "longest")
F.draft_tree(tree, step, rid, engine.tokenizer)

# %% [markdown]
# And the step of this request with the shortest accepted path (what happened there is
# computed from the trace):

# %%
# NBVAL_IGNORE_OUTPUT
step, rid = F.pick_tree(verify, "shortest")
worst = int(verify[(verify.step == step) & (verify.rid == rid)].accept_length.iloc[0])
share1 = (verify.accept_length == 1).mean()
if worst == 1:
    print(f"step {step}: the head missed at depth 1, only the bonus token came out (τ = 1); "
          f"{share1:.0%} of this request's {len(verify)} verify steps went that way")
else:
    print(f"even the worst step ({step}) accepted {worst - 1} draft token(s) plus the bonus "
          f"(τ = {worst}): no verify step of this request came out empty")
F.draft_tree(tree, step, rid, engine.tokenizer)

# %% [markdown]
# ## Chain vs tree
# `topk=1` drafts a single chain (N = S+1 forced). A tree spends more verify tokens to hedge:
# when the top guess is wrong, a sibling may be right.

# %%
# NBVAL_IGNORE_OUTPUT
import pandas as pd

shapes = {"chain S5": wb.SpecConfig(num_steps=5, topk=1),
          "tree S5 K4 N16": spec,
          "tree S5 K8 N32": wb.SpecConfig(num_steps=5, topk=8, num_draft_tokens=32)}
rows, steps = [], {}
for name, s in shapes.items():
    o = engine.generate(list(models.prompts), wb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
                        spec=s)
    taus = [x.metrics.accept_length for x in o]
    steps[name] = [t for x in o for t in x.metrics.accept_lengths]  # τ of every verify step
    rows.append({"shape": name, "verified nodes": s.num_draft_tokens,
                 "mean τ": sum(taus) / len(taus), "verify steps": len(steps[name])})
pd.DataFrame(rows).round(2)

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.viz import prose as P

chain, *trees = shapes
P.say(*[x for t in trees for x in (
    P.compare(f"τ of {t}", steps[t], steps[chain], f"the {chain}'s", above="is higher than",
              below="is lower than"), P.BR)],
      "(ratio of the mean τ per verify step, with its 95 % interval: the hedge pays in τ only "
      "where the interval says so; what it costs in verify time is 03's question).")

# %% [markdown]
# ## Step through it yourself
# `Explorer` drives the engine one verify step at a time (`add_request` + `step` under a
# tracer). Change S/K/N or the policy between steps: the output stays the same, only the trees
# change. Below it has already taken two steps; in a live kernel press **step** or **run**.
# (An exported HTML page shows a snapshot; the static figure after it is the same tree.)

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.viz.widgets import Explorer

explorer = Explorer(engine, prompt=models.prompts[2], max_new_tokens=MAX_NEW_TOKENS)
explorer.step()
explorer.step()
explorer

# %%
# NBVAL_IGNORE_OUTPUT
last = explorer.reports[-1]
F.draft_tree(explorer.tree_frame(), last.verify_step, explorer.rid, engine.tokenizer)

# %% [markdown]
# ## Recap
# - A verify step checks N tree nodes at once; τ = accepted draft tokens + 1 bonus.
# - `tracer.frame("tree")` has one row per node (token, parent, depth, draft and target
#   probabilities, accepted); `F.draft_tree` draws any (step, request) of it.
# - Chains are cheap to verify, trees hedge; which wins depends on what N tokens cost to verify
#   on the hardware — **03_acceptance** measures it.
