# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · The seeds' box, explained
#
# **You will learn** what the seeds' five numbers say about their box (8 RTX PRO 6000 Blackwell
# GPUs over PCIe Gen5, Kimi-K2.5 INT4 at TP=8, SGLang 0.5.9 + EAGLE-3), which of them a step
# model with two fitted constants reproduces, what the all-reduce costs by message size, from
# which concurrency this box should stop speculating — as a range, by chain shape and routing,
# with the measurement that would narrow it — and what the model predicts with NVLink, the EAGLE
# cap lifted, spec v2 overlap or SGLang 0.5.23's tiers.
#
# **How.** The box is data (`data/boxes/seeds.json`: every given value with its source); the
# step model prices a forward by named terms (floor, weights, collectives, attention, compute
# excess) and a speculative step as SGLang's EAGLE worker runs it; every all-reduce is priced
# by its message size on the path it takes (NCCL, the fused one-shot path, SGLang's custom
# all-reduce), from public nccl-tests tables of PCIe boxes; two constants (the per-forward
# floor and the attention cost per context token) are fitted to two of the seeds' numbers,
# every other number is a prediction (docs/LAB.md, "The box"). What-ifs keep the fitted
# constants: they are predictions, drawn as such.

# %% tags=["parameters"]
import os

FAST = os.environ.get("WORKBENCH_FAST") == "1"

# %%
# NBVAL_IGNORE_OUTPUT
import pandas as pd
import plotly.graph_objects as go

from workbench.errors import ConfigError
from workbench.lab import whatif
from workbench.lab.boxfit import fit, fusion_account, load_seeds
from workbench.lab.boxmodel import TERMS, level, what_if
from workbench.lab.boxreport import box_report
from workbench.lab.boxspec import with_sets
from workbench.lab.collectives import reading_sets
from workbench.viz import prose as P

rep = box_report("seeds")
seeds = load_seeds()
LEVELS = rep["levels"]
TAU = rep["tau"]
LO, HI = rep["tau_band"]["band"]
fitted = rep["fitted_box"]
alive = [r for r in rep["readings"] if r["band"]]
held_box = fitted  # the fitted box on the first reading the numbers leave open

# %% [markdown]
# ## 1. The all-reduce by message size, and which reading the numbers leave open
# A one-token plain step all-reduces 14 KB per layer, a 4-token verify 57 KB. The preset's NCCL
# table joins the public rows of two 8-GPU PCIe boxes; a second reading holds their 42–45 µs
# small-message latency up to the plain step's message before the same slope. The fit is redone
# under each reading; a reading is refuted when no τ puts every number within ±20 % with the
# seeds' stated signs holding.

# %%
pd.DataFrame([{"reading": r["reading"], "NCCL µs at 14 KB": round(r["nccl_us_plain"], 1),
               "NCCL µs at 57 KB": round(r["nccl_us_verify"], 1),
               "τ band": r["band"], "refuted by the numbers": r["refuted"] or "",
               "source": r["nccl_source"][:90]} for r in rep["readings"]])

# %%
fa = rep["fusion"]
msgs = pd.DataFrame(fa["messages"])
fig = go.Figure()
for state in ("fused", "unfused"):
    paths_used = ", ".join(msgs[f"path_{state}"].unique())
    fig.add_bar(x=[f"{m} ({b / 1000:.0f} KB)" for m, b in zip(msgs.forward, msgs.message_bytes,
                                                               strict=True)],
                y=msgs[f"share_{state}"], name=f"{state} ({paths_used} path)")
fig.update_layout(barmode="group", yaxis_tickformat=".0%", height=340,
                  yaxis_title="collectives' share of the forward",
                  title=f"Collectives by message size at bs = 1 (reading {rep['reading']})")
fig

# %%
refuted = [r for r in rep["readings"] if r["refuted"]]
seed_s = fa["spec_single_before_seed"]
plain_before = [fusion_account(fit(with_sets(fitted, reading_sets(fitted, r["reading"])), seeds,
                                   t), seeds)["plain_single_before_model"]
                for r in alive for t in r["band"]]
net = P.ratio("unfused plain decoding at c = 1 (model, over the τ band and open readings)",
              fa["plain_single_before_model"] / seed_s, min(plain_before) / seed_s,
              max(plain_before) / seed_s, above="is faster than", below="is slower than",
              against=f"the seeds' unfused EAGLE-3 single stream ({seed_s} tok/s)")
P.say(f"Unfused, the verify's all-reduces take {msgs.loc[1, 'us_unfused']:.0f} µs each against "
      f"the plain step's {msgs.loc[0, 'us_unfused']:.0f} µs: {msgs.loc[1, 'share_unfused']:.0%} "
      f"of the verify and {msgs.loc[0, 'share_unfused']:.0%} of a plain step. With the fitted "
      f"constants kept and only the path switched, the model gives a "
      f"{fa['verify_before_model_ms']:.1f} ms unfused verify (the seeds: "
      f"~{fa['verify_before_seed_ms']:.0f}) and {fa['spec_single_before_model']:.1f} tok/s for "
      f"the unfused single stream (the seeds: {seed_s}). ", net,
      f" — so the seeds' \"net-negative before fusion\" "
      f"{P.choose(net, 'follows from the model', 'is contradicted by it', 'is not decided by it')}"
      f". "
      + (f"Refuted by the numbers themselves: {', '.join(r['reading'] for r in refuted)} "
         f"({refuted[0]['refuted']}). " if refuted else "")
      + f"One measurement settles the all-reduce: {fa['narrow_with']}.")

# %% [markdown]
# ## 2. The five numbers: predicted beside measured
# Two are fitted, three predicted; each band is the prediction over the τ band of every reading
# the numbers leave open (the seeds measured no τ). Leave-one-out refits on the other numbers.

# %%
nums = pd.DataFrame([{"number": r["key"], "seeds": r["seed"], "unit": r["unit"],
                      "model": round(r["predicted"], 1), "error": f"{r['error']:+.0%}",
                      "band": f"{r['band'][0]:.1f}..{r['band'][1]:.1f}",
                      "role": "fitted" if r["fitted"] else "predicted"}
                     for r in rep["numbers"]])
loo = {r["key"]: f"{r['error']:+.0%}" for r in rep["loo"]}
nums["leave-one-out error"] = nums["number"].map(loo).fillna("")
nums

# %%
fig = go.Figure()
for unit in ("tok/s", "ms"):
    part = [r for r in rep["numbers"] if r["unit"] == unit]
    fig.add_scatter(x=[r["seed"] for r in part], y=[r["predicted"] for r in part],
                    error_y=dict(type="data", symmetric=False,
                                 array=[r["band"][1] - r["predicted"] for r in part],
                                 arrayminus=[r["predicted"] - r["band"][0] for r in part]),
                    mode="markers+text", text=[r["key"] for r in part],
                    textposition="top center", name=unit)
top = max(max(r["seed"], r["band"][1]) for r in rep["numbers"]) * 1.1
fig.add_scatter(x=[1, top], y=[1, top], mode="lines", line=dict(dash="dot", color="#999"),
                name="predicted = measured")
fig.update_layout(xaxis_type="log", yaxis_type="log", xaxis_title="the seeds (measured)",
                  yaxis_title="the model (band over τ and readings)", height=420,
                  title="Predicted beside measured: the five numbers")
fig

# %%
sat = next(r for r in rep["numbers"] if r["key"] == "spec_saturated")
worst = max((r for r in rep["numbers"] if not r["fitted"]), key=lambda r: abs(r["error"]))
loo_worst = max(rep["loo"], key=lambda r: abs(r["error"]))
P.say(f"With the floor at {rep['fitted']['floor_ms']:.2f} ms per target forward and attention "
      f"at {rep['fitted']['attn_ns']:.2f} ns per context token, layer and query token (τ "
      f"{TAU:.2f}), the largest error of a predicted number is {worst['key']}'s "
      f"{worst['error']:+.0%}; EAGLE-3's saturated throughput is predicted at "
      f"{sat['predicted']:.0f} tok/s against the seeds' {sat['seed']:.0f} "
      f"({sat['band'][0]:.0f}–{sat['band'][1]:.0f} over τ {LO:.2f}–{HI:.2f}). Left out of the "
      f"fit in turn, {loo_worst['key']} is missed by {loo_worst['error']:+.0%}: that is the "
      f"model's own error on a number it was not given.")

# %% [markdown]
# The seeds name no concurrency for "saturating"; the preset assumes the sweep's top level is
# 256. The same fit with the top level at 64 or 128:

# %%
pd.DataFrame(rep["saturation_level"]).set_index("top_level").round(3)

# %% [markdown]
# ## 3. Where a step's time goes

# %%
def waterfall(terms: dict, title: str) -> go.Figure:
    keys = [*TERMS, "host"]
    fig = go.Figure(go.Waterfall(x=keys + ["step"], y=[terms[k] for k in keys] + [0],
                                 measure=["relative"] * len(keys) + ["total"]))
    fig.update_layout(title=title, yaxis_title="ms", height=320, showlegend=False)
    return fig


one = level(fitted, 1, TAU)
top_c = LEVELS[-1]
sat_row = level(fitted, top_c, TAU)
waterfall(one["spec_terms"], f"EAGLE-3 step at c=1 ({one['spec_step_ms']:.1f} ms)")

# %%
waterfall(sat_row["spec_terms"], f"EAGLE-3 step at c={top_c}, run at the cap "
          f"{sat_row['spec_batch']} ({sat_row['spec_step_ms']:.0f} ms)")

# %%
share = sat_row["spec_terms"]["attention"] / sat_row["spec_step_ms"]
P.say(f"At c = {top_c} the EAGLE-3 server runs {sat_row['spec_batch']} requests at once (SGLang "
      f"resets max_running_requests to {rep['rules']['spec_max_running_requests']} for "
      f"speculation) and attention is {share:.0%} of its step. Plain decoding runs "
      f"{sat_row['plain_batch']} at once (what its KV pool holds at this workload): "
      f"{sat_row['plain_tok_s']:.0f} tok/s against {sat_row['spec_tok_s']:.0f}.")

# %% [markdown]
# ## 4. Speculation's gain vs concurrency, and where to stop
# The gain at the ends and middle of the τ band, each with its own fit; the shaded band is the
# model's largest leave-one-out error around 1 (inside it the sign is not decided).

# %%
cr = rep["crossing"]
err = cr["loo_error"]
fig = go.Figure()
fig.add_hrect(y0=1 / (1 + err), y1=1 + err, fillcolor="rgba(180,180,180,0.3)", line_width=0)
for t in (LO, (LO + HI) / 2, HI):
    b = fit(held_box, seeds, t)["box"]
    df = what_if(b, LEVELS, t)
    fig.add_scatter(x=df["concurrency"], y=df["gain"], name=f"τ {t:.2f}", mode="lines+markers")
fig.add_hline(y=1.0, line_dash="dot")
fig.update_layout(xaxis_type="log", xaxis_title="concurrency", yaxis_title="EAGLE-3 / plain",
                  height=360, title="Gain vs concurrency (model; grey: inside its error)")
fig

# %%
by_shape = pd.DataFrame(cr["by_shape"])
by_shape["crossing"] = [f"{a}" if a == b else f"{a}..{b}" for a, b in by_shape["crossing"]]
by_shape.pivot(index="shape", columns="routing", values="crossing")

# %%
lo_c, hi_c = cr["range"]
where = (f"from concurrency {lo_c} at every τ of the band" if lo_c == hi_c else
         f"from concurrency {lo_c} to {hi_c}")
undecided = cr["inside_error"]
P.say(f"Over τ {LO:.2f}–{HI:.2f} the model puts the crossing (a plain server beside the "
      f"EAGLE-3 one) {where}. "
      + (f"At c = {', '.join(map(str, undecided))} the predicted gain is within the model's "
         f"leave-one-out error (±{err:.0%}) of 1, so the model does not decide the sign there: "
         if undecided else "Outside the model's leave-one-out error everywhere: ")
      + f"{cr['narrow_with']}; and {rep['tau_band']['narrow_with']}.")

# %% [markdown]
# ## 5. What each policy would have delivered
# tok/s per concurrency (SGLang 0.5.23's tiers run under 0.5.23's server rules — spec v2
# overlap — and take the best candidate of each tier: an upper bound of what its controller
# reaches; vLLM's table as documented for EAGLE-3).

# %%
pol = pd.DataFrame(rep["policies"]).set_index("concurrency").round(0)
pol

# %% [markdown]
# ## 6. What-ifs (predictions: the fitted constants kept)
# Each changes the fitted box after the fit, never refitting (`lab box --what-if`); a what-if
# that changes no prediction is not offered, one the GPUs cannot hold is refused with its
# numbers.

# %%
NVLINK = ('{"latency_us": 8, "bus_gbps": 360, "box": "assumed 8 x NVLink 4", '
          '"source": "h200-nvlink preset"}')
WHAT_IF = {
    "NVLink instead of PCIe": [f"link.paths.nccl={NVLINK}",
                               'link.paths.fused={"latency_us": 5, "bus_gbps": 360, '
                               '"max_tokens": 2048}'],
    "one-shot all-reduce at any size": ["link.paths.fused.max_tokens=100000"],
    "EAGLE cap lifted to 256": ["server.spec_max_running_requests=256"],
    "spec v2 overlap on": ["server.spec_overlap=true"],
    "FP8 experts": ["model.checkpoint_gb=null",
                    'model.quant={"bits": 8, "group_size": 128, "scale_bits": 32}'],
}
rows, refused = [], {}
for name, sets in WHAT_IF.items():
    try:
        box = whatif.apply(fitted, sets, LEVELS, TAU)
    except ConfigError as e:  # not offered: said beside the figure
        refused[name] = str(e)
        continue
    for r in whatif.compare(fitted, box, [1, top_c], TAU):
        rows.append({"what if": name, **r})
wi = pd.DataFrame(rows)
for name, why in refused.items():
    print(f"not offered: {name}: {why}")

# %%
fig = go.Figure()
for c in (1, top_c):
    part = wi[wi["concurrency"] == c]
    fig.add_bar(x=part["what if"], y=part["what_if_gain"], name=f"c={c} (predicted)",
                marker_pattern_shape="/")
    fig.add_scatter(x=part["what if"], y=part["gain"], mode="markers",
                    name=f"c={c} as fitted", marker_symbol="line-ew-open", marker_size=30)
fig.add_hline(y=1.0, line_dash="dot")
fig.update_layout(barmode="group", yaxis_title="EAGLE-3 / plain", height=380,
                  title=f"What-ifs: predicted gain at τ {TAU:.2f}, the fitted constants kept")
fig

# %%
g = wi.set_index(["what if", "concurrency"])
moved = (g["what_if_gain"] - g["gain"]).abs().xs(top_c, level="concurrency")
best = moved.idxmax()
nv = g.loc[("NVLink instead of PCIe", 1)]
P.say(f"At c = {top_c} the largest predicted change to speculation's gain comes from '{best}' "
      f"({g.loc[(best, top_c), 'what_if_gain']:.2f} against {g.loc[(best, top_c), 'gain']:.2f} "
      f"as fitted). At c = 1 NVLink moves plain decoding {nv['plain_tok_s']:.0f} → "
      f"{nv['what_if_plain_tok_s']:.0f} tok/s and EAGLE-3 {nv['spec_tok_s']:.0f} → "
      f"{nv['what_if_spec_tok_s']:.0f}. Not offered: "
      + "; ".join(f"{k} ({v.split(': ', 1)[-1]})" for k, v in refused.items()) + ".")
