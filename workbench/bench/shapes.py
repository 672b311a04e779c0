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
speedup if drafting, accepting and committing were free). ``speedup_lo/hi`` is the 95 %
interval (over repeats, or over the prompts' paired ratios in a single run); the step samples
behind the medians travel in ``df.attrs["steps"]`` (saved in the JSON).

A trained pair and a random pair of the same shape should cost the same: that is what lets
random pairs stand in for real ones. :func:`trained_vs_random` flags (``trained_vs_random``)
a pair whose speedup intervals do not overlap, or whose plain step costs differ beyond their
interval by more than :data:`STEP_TOLERANCE`; ``bench shapes`` adds those flags to the run's.

A pretrained target (``--model`` a real checkpoint, e.g. SmolLM2-135M-Instruct, a folder or a
GGUF) gets its random twin (:func:`shape_of`: its layers, widths, heads and vocabulary; a random
head of its draft vocabulary) beside it (``twins``), run on the prompts' token ids, so the
trained-vs-random check covers its shape; the toy :data:`SHAPES` (vocab 8192) cannot take its
token ids and are left out for it (``bench shapes``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

import workbench as wb
from workbench.bench.sanity import Flag
from workbench.bench.spec import run_spec_bench
from workbench.config import SamplingParams, SpecConfig
from workbench.errors import ConfigError
from workbench.machine import machine_info
from workbench.models.config import ModelConfig
from workbench.models.synthetic import TargetShape, random_pair
from workbench.stats import mean_ratio, ratio_of

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
               repeats: int = 1, twins: bool = False) -> pd.DataFrame:
    """One row per shape (see the module docstring). ``spec`` gives (S, K, N) (default
    S5 K4 N16); ``tau`` in [1, S+1] is the posed accept length. Random pairs are cached under
    ``work``; ``tokenizer_from`` (a folder with tokenizer.json of a vocab that fits) is needed
    for text prompts. ``pairs`` (label → (target, draft) folders) adds rows for real
    checkpoints, run the same way first — e.g. the shipped pair, to check that random weights
    cost what trained ones do. ``repeats`` > 1 adds ``speedup_lo/hi`` (95 % CI over repeats).
    ``engine_config`` forces EngineConfig fields (else the measured "auto" choices). ``twins``:
    each pair is followed by a random pair of its shape (:func:`shape_of`), labelled
    ``"<label> random twin"``; prompts must then be token ids (a random target has no
    tokenizer)."""
    shapes = dict(SHAPES if shapes is None else shapes)
    base = spec or SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
    check_tau(tau, base)
    sim = dataclasses.replace(base, simulate_accept_length=tau)
    name = f"S{sim.num_steps} K{sim.topk} N{sim.num_draft_tokens} τ={tau:g}"
    todo: list[tuple[str, TargetShape | None, Any]] = []
    draft_vocab: dict[str, int] = {}
    for label, p in (pairs or {}).items():
        todo.append((label, None, tuple(p)))
        if twins:
            if any(isinstance(x, str) for x in prompts):
                raise ConfigError("run_shapes: twins need token-id prompts (a random target "
                                  "has no tokenizer)")
            shape, dv = shape_of(p[0], p[1])
            todo.append((f"{label} random twin", shape, None))
            draft_vocab[f"{label} random twin"] = dv
    todo += [(label, shape, None) for label, shape in shapes.items()]
    rows = []
    steps: dict[str, dict[str, list[float]]] = {}
    for label, shape, pair in tqdm(todo, desc="bench shapes", unit="shape"):
        if pair is None:
            assert shape is not None
            if label in draft_vocab:  # a real pair's twin: its draft vocabulary, no tokenizer
                pair = random_pair(Path(work) / f"{_slug(shape)}-d{draft_vocab[label]}", shape,
                                   draft_vocab=draft_vocab[label])
            else:
                pair = random_pair(Path(work) / _slug(shape), shape,
                                   tokenizer_from=tokenizer_from)
        with wb.Engine.from_pretrained(pair[0], draft=pair[1], config=engine_config) as engine:
            res = run_spec_bench(engine, list(prompts),  # type: ignore[arg-type]  # ids too
                                 arms={"baseline": None, name: sim},
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
            assert mc is not None  # a loaded checkpoint always has one
        s = res.summary.set_index("arm")
        plain = timing[timing["mode"] == "plain"]
        specs = timing[timing["mode"] == "spec"]
        plain_ms = float(plain["total_ms"].median())
        verify_ms = float(specs["verify_ms"].median())
        tau_seen = float(s.loc[name, "tau"])
        ci = {k: float(s.loc[name, k]) for k in ("speedup_lo", "speedup_hi") if k in s}
        if not ci:  # one run: the interval over the prompts' paired ratios
            ci = _prompt_ci(res.per_prompt, name)
        steps[label] = {"plain_ms": plain["total_ms"].astype(float).tolist(),
                        "spec_ms": specs["total_ms"].astype(float).tolist(),
                        "draft_ms": specs["draft_ms"].astype(float).tolist(),
                        "verify_ms": specs["verify_ms"].astype(float).tolist()}
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
    df.attrs["steps"] = steps
    df.attrs["machine"] = machine_info()
    df.attrs["config"] = {"tau": tau, "spec": name, "max_new_tokens": max_new_tokens,
                          "prompts": len(prompts), "simulated": True}
    return df


TRAINED_VS_RANDOM = "trained_vs_random"
STEP_TOLERANCE = 0.10  # plain-step cost of a trained vs a random pair of one shape


def _prompt_ci(per_prompt: pd.DataFrame, arm: str) -> dict[str, float]:
    """speedup_lo/hi over the prompts' paired ratios (geometric, t on the log); {} for one."""
    base = per_prompt[per_prompt["arm"] == "baseline"].set_index("prompt")["tok_s"]
    mine = per_prompt[per_prompt["arm"] == arm].set_index("prompt")["tok_s"]
    ratios = (mine / base.reindex(mine.index)).dropna().tolist()
    if len(ratios) < 2:
        return {}
    _, lo, hi, _ = ratio_of(ratios)
    return {"speedup_lo": lo, "speedup_hi": hi}


def trained_vs_random(df: pd.DataFrame, steps: Mapping[str, Mapping[str, Sequence[float]]]
                      | None = None) -> list[Flag]:
    """Flags for each trained row (``random`` False) whose random row of the same
    (layers, hidden) disagrees beyond noise: speedup intervals that do not overlap, or plain
    step costs (``steps``: label → {"plain_ms": samples}) whose ratio's interval lies wholly
    outside 1 ± :data:`STEP_TOLERANCE`. One flag on each of the two rows (matched by shape)."""
    flags: list[Flag] = []
    if "random" not in df.columns:
        return flags
    for t in df[~df["random"].astype(bool)].to_dict(orient="records"):
        twins = df[df["random"].astype(bool) & (df["layers"] == t["layers"]) &
                   (df["hidden"] == t["hidden"])]
        for r in twins.to_dict(orient="records"):
            why = []
            if all(k in t and k in r and t[k] == t[k] and r[k] == r[k]
                   for k in ("speedup_lo", "speedup_hi")):
                if t["speedup_lo"] > r["speedup_hi"] or r["speedup_lo"] > t["speedup_hi"]:
                    why.append(f"speedup {t['speedup']:.2f}× [{t['speedup_lo']:.2f}–"
                               f"{t['speedup_hi']:.2f}] vs {r['speedup']:.2f}× "
                               f"[{r['speedup_lo']:.2f}–{r['speedup_hi']:.2f}]")
            a = (steps or {}).get(t["shape"], {}).get("plain_ms")
            b = (steps or {}).get(r["shape"], {}).get("plain_ms")
            if a and b and len(a) > 1 and len(b) > 1:
                ratio, lo, hi = mean_ratio(a, b)
                if lo > 1 + STEP_TOLERANCE or hi < 1 - STEP_TOLERANCE:
                    why.append(f"plain step {ratio:.2f}× [{lo:.2f}–{hi:.2f}] the random "
                               f"pair's (beyond ±{STEP_TOLERANCE:.0%})")
            if why:
                msg = (f"{t['shape']} vs {r['shape']} (same shape {t['layers']}x{t['hidden']}): "
                       + "; ".join(why) + " — random pairs do not stand in for this one")
                flags += [Flag(TRAINED_VS_RANDOM, msg, {"shape": t["shape"]}),
                          Flag(TRAINED_VS_RANDOM, msg, {"shape": r["shape"]})]
    return flags


def shape_of(target: str | Path, draft: str | Path | None = None) -> tuple[TargetShape, int]:
    """A checkpoint's shape (folder, ``.gguf`` or pointer folder; read from its config or GGUF
    metadata, no weights loaded) and its head's draft vocabulary (``draft``'s config.json
    ``draft_vocab_size``; the random head's default 2048 without one). A target whose
    head_dim is not hidden / heads is refused: a twin could not have its cost."""
    mc = ModelConfig.from_folder(target)
    if mc.is_moe:
        raise ConfigError(f"bench shapes: {target} is a mixture-of-experts target; random twins "
                          "are dense Llama targets")
    if mc.head_dim * mc.num_attention_heads != mc.hidden_size:
        raise ConfigError(f"bench shapes: {target}: head_dim {mc.head_dim} x heads "
                          f"{mc.num_attention_heads} != hidden {mc.hidden_size}; a random twin "
                          "(head_dim = hidden / heads) would not cost the same")
    shape = TargetShape(mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size,
                        mc.num_attention_heads, mc.num_key_value_heads, mc.vocab_size)
    dv = 2048
    cfg = Path(draft) / "config.json" if draft is not None else None
    if cfg is not None and cfg.is_file():
        raw = json.loads(cfg.read_text()).get("draft_vocab_size")
        if raw is not None:
            if not isinstance(raw, int) or raw < 1:
                raise ConfigError(f"bench shapes: {cfg}: draft_vocab_size must be an integer "
                                  f">= 1, got {raw!r}")
            dv = raw
    return shape, min(dv, shape.vocab)


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
         "rows": json.loads(df.to_json(orient="records")),
         "steps": df.attrs.get("steps", {})}, indent=2) + "\n")
    return out / f"{name}.json"


def _slug(shape: TargetShape) -> str:
    return f"L{shape.layers}-D{shape.hidden}-I{shape.intermediate}-H{shape.heads}-" \
        f"KV{shape.kv_heads}-V{shape.vocab}"
