"""Peers on the same weights, bs=1 greedy, arms interleaved per prompt (ratios from one run).

* ``hf generate``: transformers ``generate`` (the reference implementation);
* ``hf prompt lookup``: transformers prompt-lookup decoding (``prompt_lookup_num_tokens``);
* ``hf assisted``: transformers assisted generation with a small draft LM (when given);
* ``hf static compiled``: transformers' fastest bs=1 mode — a static KV cache
  (``generation_config.cache_implementation = "static"``) and ``torch.compile(model.forward,
  mode="reduce-overhead", fullgraph=True)`` — the strongest peer, not the easiest;
* ``workbench``: our baseline; ``workbench eagle3``: our EAGLE-3 (when a draft is loaded);
  ``workbench [B]`` / ``workbench eagle3 [B]``: the same on a second engine (``variant``, the
  CLI's ``--engine-b``), so one engine setting's effect is measured side by side.

Every transformers arm loads the weights in the engine's dtype (``--engine dtype=bfloat16``: both
sides stream bf16 weights), so a ratio compares implementations, never precisions.

llama.cpp on the same GGUF (``--peer llamacpp``) runs in a process of its own:
``workbench.bench.llamacpp_peer``.

``startup_s`` is each arm's warm-up (its first call; for the compiled peer one call per prompt,
since it recompiles for every new prompt length), which for the compiled peer includes the
compiles; ``compile_s`` is that minus the arm's steady time for the same calls (start-up
matters to a notebook user). ``vs_hf_paired`` (with ``_lo`` / ``_hi``) is the geometric mean of
the per-prompt ratios to ``hf generate`` (each prompt's arms run back to back, so a pair shares
the machine's state) with its 95 % interval over the ``pairs`` = prompts × repeats; with
``repeats`` > 1 the summary also has 95 % intervals of tok/s and of the ratio of totals
(``vs_hf_generate``) over the repeats, which two repeats cannot narrow.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from workbench.config import SamplingParams, SpecConfig
from workbench.machine import machine_info
from workbench.models.loader import transformers_source
from workbench.stats import mean_ci

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

COMPILED = "hf static compiled"  # the peer that is warmed (and compiled) on every prompt


def run_peers(engine: Engine, prompts: list[str], max_new_tokens: int = 128,
              assistant: str | Path | None = None,
              spec: SpecConfig | None = None, repeats: int = 1,
              compiled: bool = True, variant: Engine | None = None
              ) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Returns (per-prompt rows, summary with ratios vs ``hf generate``, machine info).

    ``compiled``: include the ``hf static compiled`` peer (its compile takes minutes on a
    small CPU; the CLI leaves it out with ``--quick``)."""
    from transformers import AutoModelForCausalLM


    if repeats < 1:
        raise ValueError(f"run_peers: repeats must be >= 1, got {repeats}")
    # an HF folder as it is; a GGUF file (or a pointer folder) through transformers' GGUF load
    src, src_kw = transformers_source(engine.model_path)
    dtype = getattr(torch, engine.config.dtype)  # like for like: the engine's precision
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **src_kw).eval()
    tok = engine.tokenizer
    asst = None
    if assistant is not None:
        asst = AutoModelForCausalLM.from_pretrained(str(assistant), dtype=dtype).eval()
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    hf_kw = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                 pad_token_id=tok.eos_token_id)

    def hf_run(p: str, model: Any = hf, **extra: Any) -> list[int]:
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        with torch.inference_mode():
            out = model.generate(ids, **hf_kw, **extra)
        return out[0, ids.shape[1]:].tolist()

    arms: dict[str, Callable[[str], list[int]]] = {
        "hf generate": hf_run,
        "hf prompt lookup": lambda p: hf_run(p, prompt_lookup_num_tokens=10),
    }
    if compiled:
        hfc = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **src_kw).eval()
        hfc.generation_config.cache_implementation = "static"
        hfc.forward = torch.compile(hfc.forward, mode="reduce-overhead", fullgraph=True)
        arms[COMPILED] = lambda p: hf_run(p, model=hfc)
    arms["workbench"] = lambda p: engine.generate([p], sp)[0].token_ids
    if asst is not None:
        arms["hf assisted"] = lambda p: hf_run(p, assistant_model=asst)
    if variant is not None:
        arms["workbench [B]"] = lambda p: variant.generate([p], sp)[0].token_ids
    if spec is not None and engine.runner.draft is not None:
        arms["workbench eagle3"] = lambda p: engine.generate([p], sp, spec=spec)[0].token_ids
    if spec is not None and variant is not None and variant.runner.draft is not None:
        arms["workbench eagle3 [B]"] = lambda p: variant.generate([p], sp,
                                                                  spec=spec)[0].token_ids
    startup: dict[str, float] = {}
    for name, fn in arms.items():  # warm-up; the first call of a compiled arm compiles
        t0 = time.perf_counter()
        # the compiled peer recompiles its forward for every new prompt length (the prefill
        # shape): warm it on every prompt, so its timed runs are its best steady state and
        # all of its compiling is in startup_s / compile_s
        for p in prompts if name == COMPILED else prompts[:1]:
            fn(p)
        startup[name] = time.perf_counter() - t0
    rows = []
    todo = [(r, i, p) for r in range(repeats) for i, p in enumerate(prompts)]
    for r, i, p in tqdm(todo, desc="bench peers", unit="prompt"):
        ref: list[int] | None = None
        for name, fn in arms.items():
            t0 = time.perf_counter()
            ids = fn(p)
            dt = time.perf_counter() - t0
            if ref is None:
                ref = ids
            n = min(len(ids), len(ref))
            rows.append({"repeat": r, "prompt": i, "arm": name, "tokens": len(ids),
                         "seconds": dt, "tok_s": len(ids) / dt, "same_as_hf": ids[:n] == ref[:n]})
    df = pd.DataFrame(rows)
    g = df.groupby("arm", sort=False).agg(tokens=("tokens", "sum"), seconds=("seconds", "sum"),
                                          same_as_hf=("same_as_hf", "all"))
    g["tok_s"] = g["tokens"] / g["seconds"]
    g["vs_hf_generate"] = g["tok_s"] / g["tok_s"]["hf generate"]
    hf_best = g.loc[[a for a in g.index if a.startswith("hf")], "tok_s"].max()
    g["vs_best_hf"] = g["tok_s"] / hf_best
    if COMPILED in g.index:
        g["vs_hf_compiled"] = g["tok_s"] / g["tok_s"][COMPILED]
    g["startup_s"] = [startup[a] for a in g.index]
    per_prompt = df[df["repeat"] == 0].groupby("arm", sort=False)["seconds"]
    # compile_s: the warm-up minus what the same prompts take once compiled (with one prompt
    # the compiled peer's sum is its mean)
    warm_sum, warm_mean = per_prompt.sum(), per_prompt.mean()
    g["compile_s"] = [max(0.0, startup[a] - (warm_sum if a == COMPILED else warm_mean)[a])
                      for a in g.index]
    # the paired statistic: each (repeat, prompt)'s arm over hf generate on that same prompt,
    # run back to back; geometric mean and a Student-t interval on the logs (n = prompts ×
    # repeats), which resolves a ratio where two repeats' totals cannot
    paired = df.pivot_table(index=["repeat", "prompt"], columns="arm", values="tok_s")
    for arm in g.index:
        m, lo, hi = mean_ci([math.log(v) for v in paired[arm] / paired["hf generate"]])
        g.loc[arm, ["vs_hf_paired", "vs_hf_paired_lo", "vs_hf_paired_hi"]] = [
            math.exp(m), math.exp(lo), math.exp(hi)]
        g.loc[arm, "pairs"] = len(paired)
    if repeats > 1:
        per = df.groupby(["arm", "repeat"], sort=False)[["tokens", "seconds"]].sum()
        per["tok_s"] = per["tokens"] / per["seconds"]
        for arm in g.index:
            _, lo, hi = mean_ci(per.loc[arm, "tok_s"].tolist())
            g.loc[arm, ["tok_s_lo", "tok_s_hi"]] = [lo, hi]
            ratio = per.loc[arm, "tok_s"] / per.loc["hf generate", "tok_s"]
            _, lo, hi = mean_ci(ratio.tolist())
            g.loc[arm, ["vs_hf_generate_lo", "vs_hf_generate_hi"]] = [lo, hi]
    # the workbench arms' weight format (EngineConfig.weights: packed codes or dequantised)
    weights = (engine.choices.get("weights") or {}).get("choice", "dequant")
    return df, g.reset_index(), {**machine_info(), "dtype": engine.config.dtype,
                                 "weights": weights}
