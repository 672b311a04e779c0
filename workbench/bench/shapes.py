"""Which target/draft pair shape turns a given acceptance into a given speedup on this machine?

The bs=1 speedup of EAGLE-3 is τ × (plain step) / (speculative step): acceptance *and* what a
verify and a draft phase cost against one plain step. The second factor depends only on the
shapes and the machine, so it can be measured without trained models: random targets of several
shapes (written by ``transformers``: the real format) each with a random 1-layer EAGLE-3 head of
its width, decoding with ``SpecConfig(simulate_accept_length=τ)`` — synthetic acceptance with the
real draft, verify, commit and extend work. Outputs are then NOT the target's (marked), which is
fine: only the time is read.

Per shape: baseline and simulated-τ tok/s (arms interleaved per prompt, untraced), their ratio,
and from a traced pass over two prompts the median plain step, speculative step, its draft and
verify phases, ``verify_ratio`` = verify / plain step, and ``bound`` = τ / verify_ratio (the
speedup if drafting, accepting and committing were free).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from workbench.bench.machine import machine_info
from workbench.bench.spec import run_spec_bench
from workbench.config import SamplingParams, SpecConfig
from workbench.errors import ConfigError
from workbench.models.synthetic import TargetShape, random_pair

# The shipped target first; then deeper (as real 32-80-layer targets are), then wider.
SHAPES: dict[str, TargetShape] = {
    "18x256 (shipped)": TargetShape(18, 256, 704, 4, 2),
    "36x256": TargetShape(36, 256, 704, 4, 2),
    "72x256": TargetShape(72, 256, 704, 4, 2),
    "18x512": TargetShape(18, 512, 1408, 8, 2),
    "32x512": TargetShape(32, 512, 1408, 8, 2),
}


def run_shapes(prompts: Sequence[str | Sequence[int]],
               shapes: Mapping[str, TargetShape] | None = None, tau: float = 5.0,
               spec: SpecConfig | None = None, max_new_tokens: int = 64,
               work: str | Path = "data/work/shapes", tokenizer_from: str | Path | None = None,
               engine_config: Any = None,
               pairs: Mapping[str, tuple[str | Path, str | Path]] | None = None,
               repeats: int = 1) -> pd.DataFrame:
    """One row per shape (see the module docstring). ``spec`` gives (S, K, N) (default
    S5 K4 N16); ``tau`` in [1, S+1] is the posed accept length. Random pairs are cached under
    ``work``; ``tokenizer_from`` (a folder with tokenizer.json of a vocab that fits) is needed
    for text prompts. ``pairs`` (label → (target, draft) folders) adds rows for real
    checkpoints, run the same way first — e.g. the shipped pair, to check that random weights
    cost what trained ones do. ``repeats`` > 1 adds ``speedup_lo/hi`` (95 % CI over repeats).
    ``engine_config`` forces EngineConfig fields (else the measured "auto" choices)."""
    import workbench as wb

    shapes = dict(SHAPES if shapes is None else shapes)
    base = spec or SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
    check_tau(tau, base)
    sim = dataclasses.replace(base, simulate_accept_length=tau)
    name = f"S{sim.num_steps} K{sim.topk} N{sim.num_draft_tokens} τ={tau:g}"
    todo: list[tuple[str, TargetShape | None, Any]] = [
        (label, None, tuple(p)) for label, p in (pairs or {}).items()]
    todo += [(label, shape, None) for label, shape in shapes.items()]
    rows = []
    for label, shape, pair in tqdm(todo, desc="bench shapes", unit="shape"):
        if pair is None:
            assert shape is not None
            pair = random_pair(Path(work) / _slug(shape), shape, tokenizer_from=tokenizer_from)
        with wb.Engine.from_pretrained(pair[0], draft=pair[1], config=engine_config) as engine:
            res = run_spec_bench(engine, list(prompts), arms={"baseline": None, name: sim},
                                 max_new_tokens=max_new_tokens, progress=False,
                                 repeats=repeats)
            # step phases from a separate traced pass (tracing costs time of its own)
            sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
            with wb.trace(engine, events=["StepTiming"]) as tr:
                for p in list(prompts)[:2]:
                    engine.generate([p], sp)
                    engine.generate([p], sp, spec=sim)
            timing = tr.frame("timing")
            mc = engine.model_config
        s = res.summary.set_index("arm")
        plain = timing[timing["mode"] == "plain"]
        specs = timing[timing["mode"] == "spec"]
        plain_ms = float(plain["total_ms"].median())
        verify_ms = float(specs["verify_ms"].median())
        tau_seen = float(s.loc[name, "tau"])
        ci = {k: float(s.loc[name, k]) for k in ("speedup_lo", "speedup_hi") if k in s}
        rows.append({
            "shape": label, "random": shape is not None, "layers": mc.num_hidden_layers,
            "hidden": mc.hidden_size, "params_m": _params(mc) / 1e6, "tau": tau_seen,
            "baseline_tok_s": float(s.loc["baseline", "tok_s"]),
            "spec_tok_s": float(s.loc[name, "tok_s"]),
            "speedup": float(s.loc[name, "speedup"]),
            "plain_ms": plain_ms, "spec_ms": float(specs["total_ms"].median()),
            "draft_ms": float(specs["draft_ms"].median()), "verify_ms": verify_ms,
            "verify_ratio": verify_ms / plain_ms, "bound": tau_seen * plain_ms / verify_ms,
            **ci,
        })
    df = pd.DataFrame(rows)
    df.attrs["machine"] = machine_info()
    df.attrs["config"] = {"tau": tau, "spec": name, "max_new_tokens": max_new_tokens,
                          "prompts": len(prompts), "simulated": True}
    return df


def check_tau(tau: float, spec: SpecConfig) -> None:
    """The posed accept length must be reachable: 1 ≤ τ ≤ S + 1."""
    if not 1.0 <= tau <= spec.num_steps + 1:
        raise ConfigError(f"bench shapes: --tau {tau:g} not in [1, num_steps+1 = "
                          f"{spec.num_steps + 1}]")


def _params(mc: Any) -> int:
    shape = TargetShape(mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size,
                        mc.num_attention_heads, mc.num_key_value_heads, mc.vocab_size)
    return shape.params


def save_shapes(df: pd.DataFrame, folder: str | Path, name: str = "shapes") -> Path:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / f"{name}.csv", index=False)
    (out / f"{name}.json").write_text(json.dumps(
        {"machine": df.attrs.get("machine", machine_info()), "config": df.attrs.get("config", {}),
         "rows": json.loads(df.to_json(orient="records"))}, indent=2) + "\n")
    return out / f"{name}.json"


def _slug(shape: TargetShape) -> str:
    return f"L{shape.layers}-D{shape.hidden}-I{shape.intermediate}-H{shape.heads}-" \
        f"KV{shape.kv_heads}-V{shape.vocab}"
