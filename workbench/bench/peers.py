"""Peers on the same weights, bs=1 greedy, arms interleaved per prompt (ratios from one run).

* ``hf generate``: transformers ``generate`` (the reference implementation);
* ``hf prompt lookup``: transformers prompt-lookup decoding (``prompt_lookup_num_tokens``);
* ``hf assisted``: transformers assisted generation with a small draft LM (when given);
* ``workbench``: our baseline; ``workbench eagle3``: our EAGLE-3 (when a draft is loaded).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from workbench.bench.machine import machine_info
from workbench.config import SamplingParams, SpecConfig


def run_peers(engine: Any, prompts: list[str], max_new_tokens: int = 128,
              assistant: str | Path | None = None,
              spec: SpecConfig | None = None) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Returns (per-prompt rows, summary with ratios vs ``hf generate``, machine info)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_path),
                                              dtype=torch.float32).eval()
    tok = engine.tokenizer
    asst = None
    if assistant is not None:
        asst = AutoModelForCausalLM.from_pretrained(str(assistant), dtype=torch.float32).eval()
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    hf_kw = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                 pad_token_id=tok.eos_token_id)

    def hf_run(p: str, **extra: Any) -> list[int]:
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        with torch.inference_mode():
            out = hf.generate(ids, **hf_kw, **extra)
        return out[0, ids.shape[1]:].tolist()

    arms: dict[str, Callable[[str], list[int]]] = {
        "hf generate": hf_run,
        "hf prompt lookup": lambda p: hf_run(p, prompt_lookup_num_tokens=10),
        "workbench": lambda p: engine.generate([p], sp)[0].token_ids,
    }
    if asst is not None:
        arms["hf assisted"] = lambda p: hf_run(p, assistant_model=asst)
    if spec is not None and engine.draft is not None:
        arms["workbench eagle3"] = lambda p: engine.generate([p], sp, spec=spec)[0].token_ids
    for fn in arms.values():  # warm-up
        fn(prompts[0])
    rows = []
    for i, p in enumerate(tqdm(prompts, desc="bench peers", unit="prompt")):
        ref: list[int] | None = None
        for name, fn in arms.items():
            t0 = time.perf_counter()
            ids = fn(p)
            dt = time.perf_counter() - t0
            if ref is None:
                ref = ids
            n = min(len(ids), len(ref))
            rows.append({"prompt": i, "arm": name, "tokens": len(ids), "seconds": dt,
                         "tok_s": len(ids) / dt, "same_as_hf": ids[:n] == ref[:n]})
    df = pd.DataFrame(rows)
    g = df.groupby("arm", sort=False).agg(tokens=("tokens", "sum"), seconds=("seconds", "sum"),
                                          same_as_hf=("same_as_hf", "all"))
    g["tok_s"] = g["tokens"] / g["seconds"]
    g["vs_hf_generate"] = g["tok_s"] / g["tok_s"]["hf generate"]
    hf_best = g.loc[[a for a in g.index if a.startswith("hf")], "tok_s"].max()
    g["vs_best_hf"] = g["tok_s"] / hf_best
    return df, g.reset_index(), machine_info()
