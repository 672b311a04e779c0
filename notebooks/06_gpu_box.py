# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · The GPU box: the same experiment against SGLang
#
# **You will learn** to turn a workbench `SpecConfig` into the SGLang launch command for the
# 8-GPU box, to drive any SGLang-compatible server with `SGLangClient` (same outputs, same trace
# events as the engine), and to rehearse the whole thing locally against the workbench's own
# SGLang-compatible server — which is what runs here and in CI.

# %% tags=["parameters"]
import os

FAST = os.environ.get("WORKBENCH_FAST") == "1"
MAX_NEW_TOKENS = 24 if FAST else 96
BOX_TARGET = "/models/Kimi-K2.5-INT4"  # paths on the GPU box (placeholders here)
BOX_DRAFT = "/models/Kimi-K2.5-EAGLE3"

# %%
# NBVAL_IGNORE_OUTPUT
import workbench as wb
from workbench.viz.demo_models import demo_models

try:
    from workbench.backends.sglang import SGLangClient, launch_plan
    from workbench.serve.server import start_server
    HAVE_BACKEND = True
except ImportError as e:  # the serve extra (fastapi, uvicorn, httpx) is missing
    HAVE_BACKEND = False
    print(f"SKIPPING the live sections: {e}\n  install with: pip install -e '.[serve]'")
models = demo_models(fast=FAST)
print(models.describe())

# %% [markdown]
# ## The launch command
# `launch_plan` maps S/K/N onto SGLang's flags and says, in `notes`, what does not map. Upstream
# SGLang has no flag to stop drafting above a batch size, so `BatchThreshold` is reported, not
# silently dropped — the seeds' patched build would take `threshold_flag=`.

# %%
# NBVAL_CHECK_OUTPUT
if HAVE_BACKEND:
    spec = wb.SpecConfig(num_steps=3, topk=1, policy=wb.BatchThreshold(8))
    plan = launch_plan(BOX_TARGET, BOX_DRAFT, tp=8, spec=spec, mem_fraction_static=0.85)
    print(plan.shell())
    for note in plan.notes:
        print("note:", note)

# %% [markdown]
# On the box: run that line, wait for `GET /health`
# (`workbench.backends.sglang.wait_healthy(url)`), then point `SGLangClient` at it. Below, the
# workbench serves the micro models on a free local port with the same HTTP API
# (`/generate`, `/server_info`, `/metrics`).

# %%
# NBVAL_IGNORE_OUTPUT
if HAVE_BACKEND:
    engine = wb.Engine.from_pretrained(models.target, draft=models.draft)
    sampling = wb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    local_spec = wb.SpecConfig(num_steps=3, topk=1)
    reference = engine.generate(list(models.prompts), sampling)  # before the server owns it
    engine.set_spec(local_spec)
    server = start_server(engine)  # port 0: a free port
    client = SGLangClient(server.url)
    print("serving on", server.url, "· healthy:", client.health())

# %% [markdown]
# ## Same outputs, same trace schema
# `generate` returns `RequestOutput`s; `wb.trace(client)` records `RequestAdmitted` /
# `RequestFinished` events, so `frame("requests")` works exactly as for the engine. SGLang only
# reports the mean accept length per request (`spec_accept_length`), so per-step τ is spread
# evenly (`approx_accept_lengths`).

# %%
if HAVE_BACKEND:
    with wb.trace(client) as tr:
        served = client.generate(list(models.prompts), sampling, spec=local_spec)
    requests = tr.frame("requests")

# %%
# NBVAL_CHECK_OUTPUT
if HAVE_BACKEND:
    same = [s.token_ids == r.token_ids for s, r in zip(served, reference, strict=True)]
    print("server output == local baseline, token for token:", all(same))
    print("requests traced:", len(requests), "· all finished:",
          bool((requests.reason.isin(["length", "stop"])).all()))

# %%
# NBVAL_IGNORE_OUTPUT
if HAVE_BACKEND:
    display(requests[["rid", "output_len", "verify_ct", "tau", "ttft_s", "e2e_s"]].round(4))

# %% [markdown]
# The server's Prometheus metrics use SGLang's names, so the box's dashboards read both:

# %%
# NBVAL_IGNORE_OUTPUT
if HAVE_BACKEND:
    import httpx

    metrics = httpx.get(server.url + "/metrics").text
    print("\n".join(line for line in metrics.splitlines()
                    if line.startswith(("sglang:spec_accept", "sglang:num_requests"))))

# %%
if HAVE_BACKEND:
    client.close()
    server.stop()
    engine.close()

# %% [markdown]
# ## Recap
# - `launch_plan(target, draft, tp=8, spec=...)` is the SGLang command for a `SpecConfig`; its
#   notes list what upstream cannot express (`BatchThreshold`, cold drafts, goodput policies).
# - `SGLangClient(url)` speaks `/generate` to SGLang or to `workbench serve`, returns the
#   engine's output objects and emits the engine's trace events: notebooks 01–04 run unchanged
#   against the box (`python -m workbench bench concurrency --url ...` for the sweep).
# - Locally, `start_server(engine)` is the rehearsal: same API, outputs checked token for token.
