"""EAGLE-3 vs its own baseline at bs=1, greedy, arms interleaved per prompt (one run, ratios).

Every speculative output is compared with the baseline output token for token; a mismatch is
reported in the table (``lossless`` column), never hidden.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from workbench.bench.machine import machine_info
from workbench.config import SamplingParams, SpecConfig

DEFAULT_ARMS: dict[str, SpecConfig | None] = {
    "baseline": None,
    "chain S5": SpecConfig(num_steps=5, topk=1),
    "tree S5 K4 N16": SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
    "tree S6 K8 N32": SpecConfig(num_steps=6, topk=8, num_draft_tokens=32),
}


@dataclass(frozen=True)
class SpecBenchResult:
    per_prompt: pd.DataFrame
    summary: pd.DataFrame
    machine: dict[str, Any]

    def save(self, folder: str | Path, name: str = "spec_bs1") -> Path:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self.per_prompt.to_csv(out / f"{name}_per_prompt.csv", index=False)
        self.summary.to_csv(out / f"{name}.csv", index=False)
        (out / f"{name}.json").write_text(json.dumps(
            {"machine": self.machine, "summary": self.summary.to_dict(orient="records")},
            indent=2) + "\n")
        return out / f"{name}.json"


def run_spec_bench(engine: Any, prompts: list[str],
                   arms: dict[str, SpecConfig | None] | None = None,
                   max_new_tokens: int = 128, warmup: int = 1,
                   progress: bool = True) -> SpecBenchResult:
    """bs=1 greedy. Rows: one per (prompt, arm) with tokens, seconds, tok/s, τ, lossless."""
    arms = arms or DEFAULT_ARMS
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for spec in arms.values():  # warm-up: allocator, rotary tables, first-call overheads
        for p in prompts[:warmup]:
            engine.generate([p], sp, spec=spec)
    rows = []
    for i, p in enumerate(tqdm(prompts, desc="bench spec", unit="prompt", disable=not progress)):
        base_ids: list[int] | None = None
        for name, spec in arms.items():
            t0 = time.perf_counter()
            out = engine.generate([p], sp, spec=spec)[0]
            dt = time.perf_counter() - t0
            if spec is None:
                base_ids = out.token_ids
            rows.append({"prompt": i, "arm": name, "tokens": len(out.token_ids), "seconds": dt,
                         "tok_s": len(out.token_ids) / dt, "tau": out.metrics.accept_length,
                         "verify_ct": out.metrics.verify_ct,
                         "lossless": base_ids is not None and out.token_ids == base_ids})
    df = pd.DataFrame(rows)
    g = df.groupby("arm", sort=False).agg(tokens=("tokens", "sum"), seconds=("seconds", "sum"),
                                          tau=("tau", "mean"), lossless=("lossless", "all"))
    g["tok_s"] = g["tokens"] / g["seconds"]
    base = g["tok_s"].get("baseline", float("nan"))
    g["speedup"] = g["tok_s"] / base
    return SpecBenchResult(df, g.reset_index(), machine_info())
