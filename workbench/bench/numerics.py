"""The number format of a run, stated: which numerics each arm ran (``numerics``) and what
row-invariant numerics cost against the engine's default path in the same run
(``invariance_cost``). ``bench spec`` and ``bench peers`` print and save both."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from workbench.config import SamplingParams
from workbench.engine.engine import Engine
from workbench.stats import mean_ci


def numerics(engine: Engine) -> dict[str, Any]:
    """The engine's number format: dtype, row invariance, weights (packed or dequantised) and
    GEMM path, as it runs after init (its choices, not its config's "auto")."""
    ch = engine.choices
    return {"dtype": engine.config.dtype, "batch_invariant": engine.config.batch_invariant,
            "weights": ch.get("weights", {}).get("choice", "dequant"),
            "gemm": ch.get("gemm", {}).get("choice"),
            "attention": ch.get("attention", {}).get("choice"),
            "compile": ch.get("compile", {}).get("choice")}


def numerics_line(n: dict[str, Any]) -> str:
    return (f"numerics: {n['dtype']}, batch_invariant={n['batch_invariant']}, weights "
            f"{n['weights']}, gemm {n['gemm']}, attention {n['attention']}, compile "
            f"{n['compile']}")


def invariance_cost(engine: Engine, prompts: list[Any], max_new_tokens: int = 64,
                    repeats: int = 2) -> dict[str, Any] | None:
    """A ``batch_invariant`` engine's plain decode against the same models' default numerics
    (a baseline engine: no draft, so no row check to pass) in the same run: tok/s of the two,
    timed in turns per prompt ``repeats`` times; ``ratio`` (invariant over default) with its
    95 % interval over the per-prompt ratios; the greedy agreement of the two. None when the
    engine runs without the switch."""
    cfg = engine.config
    if not cfg.batch_invariant:
        return None
    ref = Engine.from_pretrained(engine.model_path, config=dataclasses.replace(
        cfg, batch_invariant=False))
    try:
        sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        arms = {"batch_invariant": engine, "default": ref}
        for e in arms.values():
            e.generate(prompts[:1], sp)  # warm-up
        secs = {k: 0.0 for k in arms}
        toks = dict.fromkeys(arms, 0)
        ratios: list[float] = []
        agree = []
        for r in range(repeats):
            for p in prompts:
                one: dict[str, float] = {}
                outs: dict[str, list[int]] = {}
                for name, e in arms.items():
                    t0 = time.perf_counter()
                    o = e.generate([p], sp)[0]
                    dt = time.perf_counter() - t0
                    secs[name] += dt
                    toks[name] += len(o.token_ids)
                    one[name] = len(o.token_ids) / dt
                    outs[name] = o.token_ids
                ratios.append(one["batch_invariant"] / one["default"])
                if r == 0:
                    agree.append(outs["batch_invariant"] == outs["default"])
        tok_s = {k: toks[k] / secs[k] for k in arms}
        mean, lo, hi = mean_ci(ratios)
        return {"dtype": cfg.dtype, "prompts": len(prompts), "repeats": repeats,
                "max_new_tokens": max_new_tokens, "tok_s": tok_s, "ratio": mean,
                "ratio_ci": [lo, hi], "default": numerics(ref),
                "same_greedy_output": sum(agree), "of": len(agree)}
    finally:
        ref.close()


def invariance_cost_line(c: dict[str, Any]) -> str:
    t = c["tok_s"]
    lo, hi = c["ratio_ci"]
    return (f"batch_invariant cost ({c['dtype']}, plain decode, same run): "
            f"{t['batch_invariant']:.1f} vs {t['default']:.1f} tok/s on the default path "
            f"({c['default']['attention']} attention, compile {c['default']['compile']}) = "
            f"{c['ratio']:.2f}x ({lo:.2f}-{hi:.2f}, {c['prompts']} prompts x {c['repeats']}); "
            f"greedy outputs identical on {c['same_greedy_output']} of {c['of']} prompts")
