# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Acceptance: where and why are drafts rejected, and which (S, K, N) pays?
#
# **You will learn** to read acceptance by draft depth, to check whether the head's confidence
# predicts acceptance, to see how often the target wants a token the draft vocabulary cannot even
# express, and to sweep the tree shape (S steps × top-K × N nodes) for τ and speedup.

# %% tags=["parameters"]
import os

FAST = os.environ.get("WORKBENCH_FAST") == "1"
MAX_NEW_TOKENS = 24 if FAST else 64
GRID_S = (2, 4) if FAST else (2, 4, 6)
GRID_K = (1, 2, 4) if FAST else (1, 2, 4)
GRID_N = (4, 8) if FAST else (4, 8, 16)

# %%
# NBVAL_IGNORE_OUTPUT
import workbench as wb
from workbench.viz import figures as F
from workbench.viz.demo_models import demo_models

models = demo_models(fast=FAST)
engine = wb.Engine.from_pretrained(models.target, draft=models.draft)
prompts = list(models.prompts)
print(models.describe())

# %% [markdown]
# ## Acceptance by depth
# A node at depth d can only be accepted if its whole path was. The bars are the share of
# drafted nodes accepted at each depth; the line is the share of trees (among those drafted
# that deep) whose accepted path reaches that depth.

# %%
spec = wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
with wb.trace(engine) as tr:
    engine.generate(prompts, wb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS), spec=spec)
by_depth, tree, verify = tr.frame("accept_by_depth"), tr.frame("tree"), tr.frame("verify")

# %%
# NBVAL_IGNORE_OUTPUT
F.acceptance_by_depth(by_depth)

# %%
# NBVAL_CHECK_OUTPUT
# τ = 1 + (accepted nodes over all depths) / (verify steps): the frame adds up to the metric
tau = verify.accept_length.mean()
print("τ == 1 + accepted / trees:", abs(tau - (1 + by_depth.accepted.sum() / len(verify))) < 1e-9)

# %% [markdown]
# ## Is the head's confidence informative?
# Among nodes whose parent was accepted (the only ones that could be), acceptance against the
# draft probability. A calibrated head lies on the diagonal; EAGLE-2's dynamic tree relies on
# confidence ranking, so the line should at least rise.

# %%
# NBVAL_IGNORE_OUTPUT
F.acceptance_vs_confidence(tree)

# %% [markdown]
# ## Rejections the head could never avoid
# The head predicts over a reduced draft vocabulary (`d2t`/`t2d`). When the target's next token
# is outside it, no tree can contain it. At every verify step the token the target chose after
# the accepted path is the bonus token:

# %%
# NBVAL_IGNORE_OUTPUT
import torch

t2d = engine.draft.t2d.cpu()
bonus = torch.tensor(verify.bonus_token.tolist())
outside = (~t2d[bonus]).float().mean().item()
print(f"draft vocabulary: {int(t2d.sum())} of {t2d.numel()} target tokens")
print(f"bonus tokens outside it: {outside:.1%} of {len(verify)} verify steps")

# %% [markdown]
# ## Which tree shape? A sweep over S × K × N
# All shapes run in one `run_spec_bench` call, arms interleaved per prompt; every output is
# checked against the baseline. K=1 is a chain, which forces N = S+1.

# %%
import itertools

grid = {}
for s, k, n in itertools.product(GRID_S, GRID_K, GRID_N):
    n = s + 1 if k == 1 else n
    if n <= k * s + 1 and f"S{s} K{k} N{n}" not in grid:
        grid[f"S{s} K{k} N{n}"] = wb.SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
print(len(grid), "shapes")

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.bench.spec import run_spec_bench

bench = run_spec_bench(engine, prompts[:2] if FAST else prompts, {"baseline": None, **grid},
                       max_new_tokens=MAX_NEW_TOKENS)
table = bench.summary[bench.summary.arm != "baseline"].copy()
table[["num_steps", "topk", "num_draft_tokens"]] = [
    (grid[a].num_steps, grid[a].topk, grid[a].num_draft_tokens) for a in table.arm]

# %%
# NBVAL_CHECK_OUTPUT
print("every shape lossless:", bool(bench.summary.lossless.all()))

# %% [markdown]
# τ grows with depth and width — more verified nodes, more chances:

# %%
# NBVAL_IGNORE_OUTPUT
F.speedup_heatmap(table, x="topk", y="num_draft_tokens", value="tau", facet="num_steps",
                  zmid=None)

# %% [markdown]
# …but speed is τ divided by what a step costs. Blue beats the baseline, red loses to it:

# %%
# NBVAL_IGNORE_OUTPUT
F.speedup_heatmap(table, x="topk", y="num_draft_tokens", value="speedup", facet="num_steps")

# %%
# NBVAL_IGNORE_OUTPUT
best = table.sort_values("speedup", ascending=False).iloc[0]
print(f"best shape here: {best.arm}: {best.speedup:.2f}× at τ = {best.tau:.2f}")

# %% [markdown]
# ## τ is half the story: what a verify costs on this machine
# Speed is τ × (plain step) / (speculative step). The second factor depends on the pair's shape
# and the hardware, not on training, so random-weight pairs can measure it: `run_shapes` decodes
# with `simulate_accept_length=τ` (synthetic acceptance, real draft/verify/commit work; outputs
# are not the target's and are marked so) for several target shapes. Two small shapes, live:

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.bench.shapes import run_shapes
from workbench.models.synthetic import TargetShape
from workbench.viz.demo_models import REPO_ROOT

small = {"4 × 128": TargetShape(4, 128, 256, heads=2, kv_heads=1, vocab=512),
         "16 × 128": TargetShape(16, 128, 256, heads=2, kv_heads=1, vocab=512)}
live = run_shapes([[5, 6, 7, 8, 9, 10], [11, 12, 13]], small, tau=4.0,
                  spec=wb.SpecConfig(num_steps=4, topk=2, num_draft_tokens=8),
                  max_new_tokens=32, work=REPO_ROOT / "data" / "work" / "shapes")
live[["shape", "tau", "speedup", "plain_ms", "spec_ms", "draft_ms", "verify_ratio", "bound"]]

# %% [markdown]
# The deeper target pays back more of its draft phase: the head costs the same, the plain step
# costs four times more. What it cannot change is `verify_ratio` — what verifying N tokens costs
# against decoding one, a property of the hardware (on a CPU, fp32 GEMMs turn compute-bound
# near 16 rows). `bound` = τ / verify_ratio is the speedup if drafting were free.
#
# The same study at the shipped scale (`python -m workbench bench shapes`, saved in
# `data/results/shapes.json`; the first row is the trained pair at the same posed τ):

# %%
# NBVAL_IGNORE_OUTPUT
import json

import pandas as pd

saved = REPO_ROOT / "data" / "results" / "shapes.json"
study = pd.DataFrame(json.loads(saved.read_text())["rows"]) if saved.is_file() else live
if saved.is_file():
    m = json.loads(saved.read_text())["machine"]
    print(f"saved run: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}")
F.shape_speedups(study)

# %%
# NBVAL_IGNORE_OUTPUT
top = study.sort_values("speedup").iloc[-1]
print(f"verify costs {study.verify_ratio.min():.2f}-{study.verify_ratio.max():.2f} plain steps "
      f"at every shape; the best shape here, {top['shape']}, reaches {top.speedup:.2f}× at "
      f"τ = {top.tau:.2f} (bound {top.bound:.2f}×)")

# %% [markdown]
# ## Recap
# - Acceptance decays with depth; accepted nodes per verify step, plus the bonus, is τ.
# - Some rejections are structural (target token outside the draft vocabulary); others are the
#   head's uncertainty, which its own probabilities partly predict.
# - The best (S, K, N) is a hardware question: τ rises with N, but so does verify cost. Re-run
#   the sweep on the machine you will serve from. **04** asks the same question across batch
#   sizes.
# - The pair's shape is the other half: a deeper target amortises the draft, but no shape beats
#   τ / verify_ratio, and verify_ratio belongs to the hardware (`bench shapes` measures both).
