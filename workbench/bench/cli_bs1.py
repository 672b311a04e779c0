"""``python -m workbench bench {spec,peers,shapes}``: the bs=1 benchmarks, one request at a time.

* spec: EAGLE-3 arms vs baseline (``workbench.bench.spec``);
* peers: transformers generate / static + compiled / prompt lookup / assisted vs ours
  (``workbench.bench.peers``);
* shapes: speedup vs target shape at a simulated accept length, random-weight pairs
  (``workbench.bench.shapes``);
* load: baseline and EAGLE-3 alone and beside a competing CPU-bound process it starts and
  stops itself, with the goals of ``workbench.bench.load``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.bench import cli_args as args
from workbench.bench.cli_output import finish, json_records, print_choices, run_choices, show, stamp
from workbench.bench.load import run_load_bench, verdict
from workbench.bench.numerics import (
    invariance_cost,
    invariance_cost_line,
    numerics,
    numerics_line,
)
from workbench.bench.peers import run_peers
from workbench.bench.sanity import LoadSampler, mark, sanity_flags
from workbench.bench.shapes import (
    SHAPES,
    check_tau,
    run_shapes,
    save_shapes,
    shape_of,
    trained_vs_random,
)
from workbench.bench.spec import ceiling_lines, dtype_effect, dtype_effect_line, run_spec_bench
from workbench.config import SpecConfig
from workbench.errors import ConfigError
from workbench.models.loader import load_tokenizer, resolve_path
from workbench.models.synthetic import TargetShape


def bench_spec(ns: argparse.Namespace) -> int:
    prompts = args.prompts(ns)
    repeats = args.repeats(ns)
    engine = args.engine(ns, need_draft=False)
    try:
        print_choices(engine)
        arms: dict[str, SpecConfig | None] | None = \
            None if engine.runner.draft is not None else {"baseline": None}
        res = run_spec_bench(engine, prompts, arms=arms, max_new_tokens=args.max_new(ns),
                             repeats=repeats, bound=engine.runner.draft is not None)
        choices = run_choices(engine)
        mon = engine.contention
        # a reduced dtype's speed and numerical effect against float32, stated, never silent
        effect = dtype_effect(engine, prompts[:4], args.max_new(ns))
        # the format every arm ran, and what row invariance costs beside the default path
        formats = numerics(engine)
        cost = invariance_cost(engine, prompts[:4], args.max_new(ns))
    finally:
        engine.close()
    flags = res.flags()
    show("EAGLE-3 vs baseline, bs=1, greedy", mark(res.summary, flags))
    for line in ceiling_lines(res.summary):
        print(line)
    if mon is not None:
        print(f"thread count: {len(mon.log)} re-measurement(s) during the run, "
              f"{mon.recalibrations} drift(s) on a quiet machine re-calibrated without one")
    extra = {"engine_choices": choices, "numerics": formats}
    print(numerics_line(formats))
    if effect is not None:
        print(dtype_effect_line(effect))
        extra["dtype_effect"] = effect
    if cost is not None:
        print(invariance_cost_line(cost))
        extra["invariance_cost"] = cost
    path = res.save(ns.out)
    stamp(path, flags, res.machine.get("load"), extra, "spec", mark(res.summary, flags))
    print(f"\nresults: {path}")
    return finish(ns, bool(res.summary["lossless"].all()), flags)


def _assistant(ns: argparse.Namespace, model_path: str | Path) -> str | None:
    """``--assistant`` for transformers' assisted generation, or None (the arm is left out)
    when it is missing or has another tokenizer than the target."""
    assistant = getattr(ns, "assistant", None)
    if assistant and not (Path(assistant) / "config.json").is_file():
        return None  # no small draft LM shipped
    if assistant and not same_tokenizer(assistant, model_path):
        print(f"peers: {assistant} has another tokenizer than the target ({model_path}); "
              "the assisted arm is left out")
        return None
    return assistant


def same_tokenizer(a: str | Path, b: str | Path) -> bool:
    """Do two model paths (folders, GGUF files or pointer folders) carry the same vocabulary
    (token → id) and special tokens? False when either has no tokenizer."""
    ta, tb = load_tokenizer(resolve_path(a)), load_tokenizer(resolve_path(b))
    if ta is None or tb is None:
        return False
    return bool(ta.get_vocab() == tb.get_vocab()
                and ta.all_special_tokens == tb.all_special_tokens)


def bench_peers(ns: argparse.Namespace) -> int:
    shape = args.spec(ns)
    repeats = args.repeats(ns)
    prompts = args.prompts(ns)
    engine = args.engine(ns, need_draft=False)
    variant = None
    extra: dict[str, Any] = {}
    try:
        if getattr(ns, "engine_b", ""):
            variant = args.engine(ns, need_draft=False, variant=True)
            print(f"[B]: --engine-b {ns.engine_b}")
            print_choices(variant)
        spec = shape if engine.runner.draft is not None else None
        assistant = _assistant(ns, engine.model_path)
        print_choices(engine)
        with LoadSampler() as load:
            rows, summary, machine = run_peers(
                engine, prompts, max_new_tokens=args.max_new(ns), spec=spec,
                assistant=assistant, repeats=repeats, compiled=not getattr(ns, "quick", False),
                variant=variant)
        choices = run_choices(engine)
        extra = {"numerics": numerics(engine)}
        print(numerics_line(extra["numerics"]))
        if variant is not None:
            extra |= {"engine_b": ns.engine_b, "engine_b_choices": run_choices(variant),
                      "numerics_b": numerics(variant)}
            print("[B] " + numerics_line(extra["numerics_b"]))
    finally:
        engine.close()
        if variant is not None:
            variant.close()
    flags = sanity_flags(summary, load=load.as_dict())
    summary = mark(summary, flags)
    show("peers, bs=1, greedy (ratios vs hf generate; startup_s: first call incl. compile)",
         summary)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out / "peers_per_prompt.csv", index=False)
    summary.to_csv(out / "peers.csv", index=False)
    (out / "peers.json").write_text(json.dumps(
        {"machine": machine, "spec": ns.spec if spec is not None else None,
         "summary": json_records(summary)},
        indent=2) + "\n")
    stamp(out / "peers.json", flags, load.as_dict(), {"engine_choices": choices, **extra},
          "peers", summary)
    print(f"\nresults: {out / 'peers.json'}")
    return finish(ns, True, flags)


def bench_shapes(ns: argparse.Namespace) -> int:
    tau = float(ns.tau)
    spec = args.spec(ns)
    check_tau(tau, spec)  # before anything is loaded
    prompts: list[Any] = args.prompts(ns)
    shapes = dict(list(SHAPES.items())[:2]) if ns.quick else SHAPES
    pairs = {}
    has_draft = bool(ns.draft) and (Path(ns.draft) / "config.json").is_file()
    if has_draft:
        pairs["shipped (trained)"] = (ns.model, ns.draft)
    twins = pretrained(ns.model)
    if twins:  # its random twin instead of the toy shapes, on the prompts' token ids
        if not has_draft:
            raise ConfigError(f"bench shapes --model {ns.model}: a pretrained target is run with "
                              "its head and its random twin: pass --draft (its EAGLE-3 head)")
        pairs = {"trained pair": (ns.model, ns.draft)}
        shapes = {}
        prompts = token_ids(ns.model, prompts)
        print(f"{ns.model}: a pretrained target (vocab {twins}); its random twin stands in for "
              "the toy shapes (vocab 8192), which cannot take its token ids")
    with LoadSampler() as load:
        df = run_shapes(prompts, shapes, tau=tau, spec=spec, max_new_tokens=args.max_new(ns),
                        tokenizer_from=None if twins else ns.model, pairs=pairs,
                        repeats=args.repeats(ns), engine_config=args.engine_config(ns),
                        twins=bool(twins))
    # a trained and a random pair of one shape that disagree beyond noise: flagged
    flags = sanity_flags(df, load=load.as_dict()) + trained_vs_random(df, df.attrs["steps"])
    df = mark(df, flags)
    show(f"speedup vs target shape at a simulated accept length (random weights; "
         f"{df.attrs['config']['spec']}, bs=1 greedy)",
         df.drop(columns=["layers", "hidden", "random"]))
    path = save_shapes(df, ns.out)
    stamp(path, flags, load.as_dict(), None, "shapes", df)
    print(f"\nresults: {path}")
    return finish(ns, True, flags)


def pretrained(model: str | Path) -> int:
    """The vocabulary size of ``model`` when it is not the toy shapes' (8192: a pretrained
    target such as SmolLM2's 49152, a folder or a GGUF), else 0."""
    vocab = shape_of(model)[0].vocab
    return vocab if vocab != TargetShape.vocab else 0


def token_ids(model: str | Path, prompts: list[str]) -> list[list[int]]:
    """``prompts`` encoded by ``model``'s tokenizer as the engine encodes text (no added
    special tokens; a chat-rendered prompt carries its own)."""
    tok = load_tokenizer(resolve_path(model))
    if tok is None:
        raise ConfigError(f"--model {model}: no tokenizer to encode the prompts with")
    return [list(tok.encode(p, add_special_tokens=False)) for p in prompts]


def bench_load(ns: argparse.Namespace) -> int:
    shape = args.spec(ns)
    prompts = args.prompts(ns)
    engine = args.engine(ns, need_draft=True)
    try:
        print_choices(engine)
        with LoadSampler() as load:
            res = run_load_bench(engine, prompts, shape, max_new_tokens=args.max_new(ns),
                                 repeats=args.repeats(ns))
        choices = run_choices(engine)
    finally:
        engine.close()
    show(f"bs=1 greedy, alone vs beside one CPU-bound process pinned to a core "
         f"(S{shape.num_steps}K{shape.topk}N{shape.num_draft_tokens})", res.summary)
    show("goals (issue 26)", res.goals)
    print(verdict(res))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    res.rows.to_csv(out / "load_per_prompt.csv", index=False)
    res.summary.to_csv(out / "load.csv", index=False)
    path = out / "load.json"
    path.write_text(json.dumps({"summary": json_records(res.summary),
                                "goals": json_records(res.goals), "phases": res.phases},
                               indent=2, default=str) + "\n")
    flags: list[object] = []
    stamp(path, flags, load.as_dict(), {"engine_choices": choices}, "load",
          pd.concat([res.summary, res.goals], ignore_index=True))
    print(f"\nresults: {path}")
    return finish(ns, bool(res.summary["lossless"].all()), flags)
