# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Partial init: can a half-built engine ever serve a request?
#
# **You will learn** how the engine's staged, all-or-nothing initialization turns an init
# failure into one clear error naming the stage — with no engine object left behind — and how
# the opt-in fallback builds an explicit, labelled baseline engine instead.
#
# **The story.** The dynamic-disable patch of notebook 04 read `self.spec_disable_batch_threshold`
# on the first decode request and crashed with `AttributeError` — although `__init__` set it.
# The attribute was assigned *after* `init_attention_backend()` / `init_cuda_graphs()`; one of
# those failed, the error was swallowed up the call chain, and a partially initialized
# `EAGLEWorkerV2` went on to serve. The fix that shipped was defensive (assign the attribute
# earlier). The workbench makes the whole class of bug impossible instead:
#
# 1. every attribute exists, with a safe default, before the first fallible stage;
# 2. each stage (load config → target → draft → KV pools → attention backends → CUDA graphs →
#    self-check) is its own function (`engine/stages.py`) and emits an `InitStage` event;
# 3. a failing stage raises `EngineInitError(stage=..., cause=...)`, frees what was allocated,
#    and the constructor never returns an object.

# %% tags=["parameters"]
import os

FAST = os.environ.get("WORKBENCH_FAST") == "1"

# %%
# NBVAL_IGNORE_OUTPUT
import workbench as wb
from workbench.trace.tracer import RecordingTracer
from workbench.viz import figures as F
from workbench.train.demo_models import demo_models

models = demo_models(fast=FAST)
print(models.describe())
print("init stages:", ", ".join(wb.faults.INIT_STAGES))

# %% [markdown]
# ## Inject the seeds' failure
# `wb.faults.inject` arms a named failure point. We fail the draft's attention backend — the
# stage the seeds' worker never finished. The tracer passed to the constructor records the init
# events even though no engine comes out.

# %%
rec = RecordingTracer()
engine = None
with wb.faults.inject("init:draft_attention_backend"):
    try:
        engine = wb.Engine(models.target, models.draft, tracer=rec)
    except wb.EngineInitError as e:
        error = e

# %%
# NBVAL_CHECK_OUTPUT
print("error:", type(error).__name__)
print("stage:", error.stage)
print("cause:", type(error.cause).__name__, "-", error.cause)
print("engine object escaped:", engine is not None)

# %% [markdown]
# The stages up to the failure ran and were recorded; nothing after it ran:

# %%
# NBVAL_CHECK_OUTPUT
for row in rec.frame("init").itertuples():
    print(f"{row.stage:24s} {row.status}")

# %%
# NBVAL_IGNORE_OUTPUT
F.init_stages(rec.frame("init"))

# %% [markdown]
# ## Opt-in fallback: an explicit baseline engine
# Some deployments prefer serving without speculation to not serving. With
# `EngineConfig(allow_baseline_fallback=True)` a failure in a *draft* stage drops the draft and
# continues; the `InitStage` event says `fallback`, and the engine says so itself.

# %%
rec = RecordingTracer()
with wb.faults.inject("init:draft_attention_backend"):
    fallback = wb.Engine(models.target, models.draft, tracer=rec,
                         config=wb.EngineConfig(allow_baseline_fallback=True))

# %%
# NBVAL_CHECK_OUTPUT
print("baseline_only:", fallback.baseline_only, "· draft:", fallback.runner.draft)
for row in rec.frame("init").itertuples():
    print(f"{row.stage:24s} {row.status}")

# %%
# NBVAL_IGNORE_OUTPUT
F.init_stages(rec.frame("init"))

# %% [markdown]
# Asking it to speculate is an error that names why — not a crash on the first decode step:

# %%
# NBVAL_CHECK_OUTPUT
try:
    fallback.set_spec(wb.SpecConfig(num_steps=4, topk=1))
except wb.ConfigError as e:
    print("ConfigError:", e)

# %%
# NBVAL_CHECK_OUTPUT
plain = fallback.generate([models.prompts[0]],
                         wb.SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
print("baseline engine generates:", len(plain.token_ids), "tokens,", plain.finish_reason)

# %% [markdown]
# A failure outside the draft stages is never papered over, fallback or not:

# %%
# NBVAL_CHECK_OUTPUT
with wb.faults.inject("init:attention_backend"):
    try:
        wb.Engine(models.target, models.draft,
                  config=wb.EngineConfig(allow_baseline_fallback=True))
    except wb.EngineInitError as e:
        print("EngineInitError at stage:", e.stage)

# %% [markdown]
# ## After init: one bad request, not a dead server
# Run-time faults are scoped too. Non-finite logits for one request (`step:nan_logits@rid`) fail
# that request with an error; the others in the same batch finish normally.

# %%
engine = wb.Engine.from_pretrained(models.target, draft=models.draft)
engine.set_spec(wb.SpecConfig(num_steps=4, topk=1))
rids = [engine.add_request(p, wb.SamplingParams(max_new_tokens=12, ignore_eos=True))
        for p in models.prompts[:3]]
with wb.faults.inject(f"step:nan_logits@{rids[1]}"):
    while engine.has_unfinished():
        engine.step()

# %%
# NBVAL_CHECK_OUTPUT
for rid in rids:
    out = engine.output(rid)
    print(f"request {rids.index(rid)}: {out.finish_reason:6s} {len(out.token_ids):2d} tokens",
          "·", (out.error or "ok").split(":")[-1].strip())

# %% [markdown]
# ## Recap
# - Init is staged and all-or-nothing: `EngineInitError.stage` names the failed stage and no
#   engine object escapes, so no request can ever meet a half-built engine.
# - `allow_baseline_fallback=True` is the explicit alternative: a labelled baseline engine
#   (`baseline_only`, an `InitStage` `fallback` event), which refuses `set_spec` with a reason.
# - `wb.faults.inject("init:<stage>")` / `("step:<phase>@<rid>")` reproduce these failures in a
#   test or a notebook cell; `WORKBENCH_FAULTS=...` does it from the environment.
