# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Train a draft head: what does EAGLE-3 training buy, step by step?
#
# **You will learn** to train an EAGLE-3 head for a target with the training-time test (the
# head unrolls several draft steps on its own outputs, as it will when serving), to read its
# training curves, and to check the exported checkpoint in the engine: standard format, lossless
# outputs, and its τ next to the demo head's (the same recipe, trained much longer).

# %% tags=["parameters"]
import os

FAST = os.environ.get("WORKBENCH_FAST") == "1"
STEPS = 120 if FAST else 100  # the shipped head's own training is read from its folder below
MAX_NEW_TOKENS = 32 if FAST else 96

# %%
# NBVAL_IGNORE_OUTPUT
import json
import tempfile
from pathlib import Path

import workbench as wb
from workbench.train.eagle3 import DraftTrainConfig, train_draft
from workbench.viz import figures as F
from workbench.train.demo_models import demo_models

models = demo_models(fast=FAST)
work = Path(tempfile.mkdtemp(prefix="wb-notebook-07-"))
print(models.describe(), "· training into", work.name)

# %% [markdown]
# ## Configure
# One frozen dataclass holds the whole recipe (`dataclasses.replace` to vary it). The micro
# target is trained on a few standard-library files, so the head trains on the same ones;
# `regenerate` would add the target's own continuations (slower, better τ).

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.engine import contention

# two OpenMP threads sharing 2 busy cores with other work collapse far below one: measured
# here (other processes' CPU use over a short window), the training takes one thread then
busy = contention.measure(0.5).reasons()
TRAIN_THREADS = 1 if busy else 0  # 0: torch's default
print("training threads:", TRAIN_THREADS or "torch default",
      f"(contended: {'; '.join(busy)})" if busy else "(machine quiet)")

# %%
micro = models.kind == "micro"
cfg = DraftTrainConfig(
    target=str(models.target), out=str(work / "head"), work=str(work / "work"),
    corpus=str(models.target.parent / "corpus") if micro else "",
    draft_vocab_size=128 if micro else 2048, steps=STEPS, batch=4,
    seq_len=48 if micro else 128, lr=3e-3 if micro else 1e-3, warmup=10, ttt_steps=5,
    regenerate=False, eval_batches=2, ckpt_every=10,  # a history point every 10 steps
    threads=TRAIN_THREADS)

# %%
# NBVAL_IGNORE_OUTPUT
summary = train_draft(cfg)
print(f"{summary['steps']} steps · {summary['tokens']:,} tokens · {summary['seconds']:.1f} s · "
      f"{summary['parameters']:,} trainable parameters")

# %% [markdown]
# ## Training curves
# The loss sums the forward-KL of every unrolled step (weights 0.8^j). The accuracy of step j is
# how often the head's top-1 after j of its own steps matches the target's: step 0 is the
# classic next-token guess, later steps are what a deep tree relies on.

# %%
# NBVAL_IGNORE_OUTPUT
F.training_curves(summary["history"])

# %%
# NBVAL_IGNORE_OUTPUT
print("estimated chain τ from held-out accuracies:",
      {k: round(v, 2) for k, v in summary["est_accept_length_chain"].items()})

# %% [markdown]
# ## The checkpoint is a standard EAGLE-3 folder
# The same layout SGLang and vLLM load (DESIGN.md §6): one decoder layer, `fc` fusing three
# target layers, a reduced vocabulary with `d2t`/`t2d`.

# %%
# NBVAL_CHECK_OUTPUT
from safetensors import safe_open

head = Path(cfg.out)
config = json.loads((head / "config.json").read_text())
print("architectures:", config["architectures"], "· layers:", config["num_hidden_layers"])
with safe_open(str(next(head.glob("*.safetensors"))), "pt") as f:
    names = sorted(f.keys())
print("tensors:", [n for n in names if not n.startswith("midlayer.")])
print("midlayer:", sorted({n.split(".")[1] for n in names if n.startswith("midlayer.")}))

# %% [markdown]
# ## Use it
# Load it like any draft. Greedy outputs must not change whatever the head; τ says how much the
# training bought. For comparison: the demo head of the same target (its training is described
# by the cell's output below).

# %%
# NBVAL_IGNORE_OUTPUT
sampling = wb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
spec = wb.SpecConfig(num_steps=4, topk=1)
mine = wb.Engine.from_pretrained(models.target, draft=head)
demo = wb.Engine.from_pretrained(models.target, draft=models.draft)
plain = mine.generate(list(models.prompts), sampling)
outs = {"this notebook's head": mine.generate(list(models.prompts), sampling, spec=spec),
        f"{models.kind} demo head": demo.generate(list(models.prompts), sampling, spec=spec)}
from workbench.viz import prose as P

taus = {name: sum(x.metrics.accept_length for x in o) / len(o) for name, o in outs.items()}
for name, tau in taus.items():
    print(f"{name:22s} τ = {tau:.2f}")
if models.kind == "micro":
    from workbench.train.demo_models import recipe

    demo_steps = recipe()["draft"].get("steps")
    print(f"the micro demo head trained {demo_steps} steps; this one {summary['steps']}")
else:  # what the shipped head's own training summary says
    shipped = json.loads((Path(models.draft) / "training_summary.json").read_text())
    source = ("the target's own continuations" if shipped["config"].get("regenerate")
              else "the corpus")
    print(f"the shipped head trained {shipped['steps']} steps "
          f"({shipped['seconds'] / 60:.0f} min) on {source}; this one {summary['steps']} "
          "on the held-in corpus")
# per verify step: τ of every step of every prompt, the ratio of the means with its interval
steps_of = {name: [t for x in o for t in x.metrics.accept_lengths] for name, o in outs.items()}
mine_name, demo_name = steps_of
P.say(P.compare(f"τ of {mine_name}", steps_of[mine_name], steps_of[demo_name],
                f"the {demo_name}'s", above="is higher than", below="is lower than"))

# %%
# NBVAL_CHECK_OUTPUT
print("lossless with the new head:",
      all(a.token_ids == b.token_ids for a, b in
          zip(outs["this notebook's head"], plain, strict=True)))

# %%
# NBVAL_IGNORE_OUTPUT
o = outs["this notebook's head"][0]
F.colored_text(o.token_ids, o.from_draft, mine.tokenizer)

# %% [markdown]
# ## Recap
# - `train_draft(DraftTrainConfig(...))` trains and exports a head; rerunning the same config
#   resumes from `<work>/ckpt.pt`.
# - The training-time test trains the later draft steps on the head's own features; their
#   accuracy, not only step 0's, decides how deep a tree is worth drafting.
# - The export is a standard `LlamaForCausalLMEagle3` folder: the engine, SGLang
#   (`--speculative-draft-model-path`) and vLLM load it; outputs stay lossless whatever the head.
