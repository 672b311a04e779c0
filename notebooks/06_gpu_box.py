# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · The GPU box: dynamic speculation disable on upstream SGLang, no patch
#
# The seeds' team patched SGLang's EAGLE worker to stop drafting above a batch size, and the
# server crashed on its first decode. SGLang 0.5.23 can do it without a patch: **adaptive
# speculation** routes each decode batch to a tier of step counts, and a tier of `[0]` decodes
# plainly.
#
# **You will learn** to turn the threshold `bench threshold` chose into the box's launch
# (flags + tiers file), to read *where* SGLang will draft (the routing table, checked against
# SGLang's own router in the tests), to check that the server really runs adaptive, to read the
# box's per-request records into the same `requests` frame as the engine's trace — and what
# upstream still cannot express.

# %% tags=["parameters"]
import os
from pathlib import Path

import workbench as wb

DATA = Path(wb.__file__).resolve().parents[1] / "data"  # the repository's data/
FAST = os.environ.get("WORKBENCH_FAST") == "1"
MAX_NEW_TOKENS = 16 if FAST else 64
BOX_TARGET = "/models/Kimi-K2.5-INT4"  # paths on the GPU box (placeholders here)
BOX_DRAFT = "/models/Kimi-K2.5-EAGLE3"
SGLANG_VERSION = "0.5.23"
# `python -m workbench bench threshold --url BASELINE_URL,EAGLE3_URL --out DIR` on the box writes
# DIR/threshold.json; here, the committed CPU sweep in data/results (what it ran: printed below)
from workbench.viz.report import results_dir

THRESHOLD_RESULTS = results_dir() / "concurrency.json"
# the box's --export-metrics-to-file-dir; here, a sample run written with SGLang's writer code
RECORDS = DATA / "sglang"
BOX_URL = None  # e.g. "http://box:30000" to ask the real server

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.remote.figures import routing_figure
from workbench.remote.launch import launch_plan, plan_from_threshold, threshold_from
from workbench.remote.records import read_request_metrics

try:
    from workbench.remote.sglang import SGLangClient, sglang_accept_lengths
    from workbench.serve.server import start_server
    HAVE_SERVE = True
except ImportError as e:  # the serve extra (fastapi, uvicorn, httpx) is missing
    HAVE_SERVE = False
    print(f"SKIPPING the live section: {e}\n  install with: pip install -e '.[serve]'")

# %% [markdown]
# ## 1 · From the measured crossover to the launch
# `bench threshold` sweeps the baseline and EAGLE-3 arms over concurrency and suggests
# `BatchThreshold(n)`: the largest level below the one where the baseline catches up. The file
# here is a saved CPU sweep — its command, models, machine and conditions are printed below
# (the crossover on the box will differ: measure it there).

# %% tags=["results"]
# NBVAL_IGNORE_OUTPUT
import json

from IPython.display import display

from workbench.remote.launch import threshold_from
from workbench.viz import prose as P
from workbench.viz.report import conditions_block, saved_run_line

n, crossover = threshold_from(THRESHOLD_RESULTS)
saved_doc = json.loads(THRESHOLD_RESULTS.read_text())
cfg = saved_doc.get("config", {})
reps = cfg.get("repeats", 1)
display(P.say(saved_run_line(THRESHOLD_RESULTS.parent, "concurrency", saved_doc), P.BR,
              f"levels {cfg.get('levels')}, {reps} repeat{'s' if reps != 1 else ''}: the "
              f"baseline catches up at concurrency {crossover} → BatchThreshold({n})"
              + (" — from point estimates of a single repeat: not resolved at this noise; "
                 "rerun with --repeats 3 before trusting it on a box" if reps < 2 else ".")))
conditions_block(saved_doc.get("engine_choices") or {}, THRESHOLD_RESULTS.name,
                 saved_doc.get("machine"), saved_doc.get("load"))

# %% [markdown]
# `plan_from_threshold` makes the launch: a chain (adaptive tiers need `topk 1`), the tiers
# file `{"1": [S], "n+1": [0]}` and the flags that read it. `plan.script()` writes the file and
# launches — paste it on the box.

# %%
# NBVAL_CHECK_OUTPUT
spec = wb.SpecConfig(num_steps=5, topk=1, draft_state="warm")
plan = plan_from_threshold(THRESHOLD_RESULTS, BOX_TARGET, BOX_DRAFT, spec=spec, tp=8,
                           sglang_version=SGLANG_VERSION, export_metrics_dir="/data/records",
                           enable_metrics=True, mem_fraction_static=0.85)
print(plan.script())
for note in plan.notes:
    print("note:", note)

# %% [markdown]
# ## 2 · Where SGLang drafts: the routing table
# For every decode batch size up to the server's cap on running requests (EAGLE-3 defaults to
# 48): the size SGLang's router looks up, the tier, the steps it runs — beside the workbench
# policy's decision. Without an explicit `--cuda-graph-bs-decode` the router sees raw batch
# sizes, so the threshold is exact.

# %%
table = plan.routing_table()
print("SGLang agrees with the policy at every batch size:", bool(table.agree.all()))
table.iloc[n - 2 : n + 3]

# %%
# NBVAL_IGNORE_OUTPUT
routing_figure(table, f"BatchThreshold({n}) on SGLang {SGLANG_VERSION}: steps per batch size")

# %% [markdown]
# Pin the capture list (`cuda_graph_bs_decode=`) and the router pads each batch up to the next
# listed size first. With SGLang's default speculative list (1–8, 10, 12, …) a threshold of 9
# pads batch 9 to 10 and stops drafting one batch early; the plan says so and proposes the
# nearest thresholds the list makes exact.

# %%
# NBVAL_CHECK_OUTPUT
from workbench.remote.adaptive import spec_decode_capture_sizes

pinned = launch_plan(BOX_TARGET, BOX_DRAFT, spec=wb.SpecConfig(5, 1, draft_state="warm",
                                                               policy=wb.BatchThreshold(9)),
                     cuda_graph_bs_decode=spec_decode_capture_sizes(48))
print("differs at batch sizes:", pinned.differ, "· exact instead:", pinned.proposed_thresholds)

# %%
# NBVAL_IGNORE_OUTPUT
routing_figure(pinned.routing_table(16), "BatchThreshold(9) with a pinned capture list")

# %% [markdown]
# The seeds' box ran SGLang 0.5.9, which has no adaptive tiers: the plan says to upgrade (and
# what that launch would do instead), rather than emit flags 0.5.9 does not know.

# %%
# NBVAL_CHECK_OUTPUT
old = launch_plan(BOX_TARGET, BOX_DRAFT, spec=wb.SpecConfig(5, 1, draft_state="warm",
                                                         policy=wb.BatchThreshold(n)),
                  sglang_version="0.5.9")
print(old.notes[1])

# %% [markdown]
# ## 3 · Is the server really adaptive?
# SGLang turns adaptive off with only a warning when it cannot run it (topk ≠ 1, attention DP,
# …) and then speculates at every batch size. `SGLangClient` reads the *resolved*
# `speculative_adaptive` from `/server_info` and refuses to run a `BatchThreshold` spec as a
# threshold experiment on a static server. Rehearsed here on the workbench's own
# SGLang-compatible server (static speculation: the client must refuse).

# %%
# NBVAL_IGNORE_OUTPUT
if HAVE_SERVE:
    from workbench.train.demo_models import demo_models

    models = demo_models(fast=FAST)
    engine = wb.Engine.from_pretrained(models.target, draft=models.draft)
    prompts = list(models.prompts)
    # different budgets: the batch shrinks as requests finish, the last ones draft
    sampling = [wb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS * (i + 1) // len(prompts))
                for i in range(len(prompts))]
    local = wb.SpecConfig(num_steps=3, topk=1, policy=wb.BatchThreshold(2), draft_state="warm")
    reference = engine.generate(prompts, sampling, spec=local)
    engine.set_spec(wb.SpecConfig(num_steps=3, topk=1))
    server = start_server(engine)  # port 0: a free port
    client = SGLangClient(server.url)
    if BOX_URL:  # the real box: is it adaptive?
        with SGLangClient(BOX_URL) as box:
            print(BOX_URL, "runs speculation:", box.speculation_mode())

# %%
# NBVAL_CHECK_OUTPUT
if HAVE_SERVE:
    print("server runs speculation:", client.speculation_mode())
    try:
        client.generate(prompts[:1], sampling[:1], spec=local)
    except wb.ConfigError as e:
        print("refused:", str(e)[str(e).index("/server_info"):])

# %% [markdown]
# τ means the same on both sides: SGLang counts an adaptive steps-0 round as a verify round with
# 0 correct drafts (accept length 1); `sglang_accept_lengths` counts the engine's plain steps
# the same way, and the client reads per-round lengths from `spec_correct_drafts_histogram`.

# %%
# NBVAL_IGNORE_OUTPUT
if HAVE_SERVE:
    served = client.generate(prompts, sampling)
    same = [s.token_ids == r.token_ids for s, r in zip(served, reference, strict=True)]
    print("server output == engine under BatchThreshold(2), token for token:", all(same))
    for r in reference:
        lengths = sglang_accept_lengths(r.metrics)
        print(f"rid {r.rid}: engine τ {r.metrics.accept_length:.2f} over "
              f"{r.metrics.verify_ct} drafting rounds; SGLang-counted τ "
              f"{sum(lengths) / len(lengths):.2f} over {len(lengths)} rounds")
    client.close()
    server.stop()
    engine.close()

# %% [markdown]
# ## 4 · The box's records, read back
# With `export_metrics_dir=` the launch adds `--export-metrics-to-file`: SGLang appends one JSON
# record per finished request to `sglang-request-metrics-YYYYMMDD_HH.log`.
# `read_request_metrics` turns a folder of them into the trace's `requests` frame (same
# columns as `wb.trace(engine).frame("requests")`), τ counted as above. The sample: 40
# requests of a `BatchThreshold(8)` run, 8 alone (drafting) and 32 under load (plain).

# %%
# NBVAL_CHECK_OUTPUT
records = read_request_metrics(RECORDS)
records["regime"] = (records.tau > 1).map({True: "drafting", False: "plain (tier [0])"})
print(records.groupby("regime").agg(requests=("rid", "size"), tau=("tau", "mean"),
                                    rounds=("verify_ct", "mean")).round(2))

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.viz.figures import latency_cdf

latency_cdf(records.assign(e2e_ms=records.e2e_s * 1e3), "e2e_ms", by="regime")

# %% [markdown]
# ## 5 · What upstream cannot express
# - **Goodput policies** (`wb.Goodput`): they pick a shape per step from a cost model and live
#   acceptance; SGLang's tiers are a fixed table by batch size (its own adaptation moves between
#   a tier's candidates by acceptance, not by cost). `launch_plan` notes it and launches
#   `Always()`.
# - **Cold drafts with a catch-up window** (`draft_state="cold"/"auto"`): in a `[0]` tier SGLang
#   still extends the draft every step (warm). `SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1` skips
#   it — experimental, and without the workbench's bounded catch-up when drafting resumes.
# - **Trees with adaptive** (topk > 1): adaptive runs chains only; a `BatchThreshold` with a
#   tree spec is refused by the plan (SGLang would silently fall back to static).
# - **Per-step and per-token traces**: `--spec-trace-dir` parses but nothing writes to it; the
#   records carry per-request counts and a histogram of correct drafts, no per-step timeline.
# - **An idle loaded draft** (`Never()` with a draft): launched as the plain baseline.
#
# ## Recap
# - `plan_from_threshold(results, target, draft, spec=...)` → `plan.script()` is the box's
#   launch; `plan.notes` lists what does not map, `plan.differ` where SGLang would decide
#   otherwise than the policy.
# - `plan.routing_table()` / `routing_figure(...)`: steps per batch size; `make test` routes
#   every plan through SGLang 0.5.23's own `AdaptiveSpeculativeParams`.
# - `SGLangClient.speculation_mode()` checks the server really runs adaptive; records from
#   `--export-metrics-to-file` read back with `read_request_metrics(dir)`.
