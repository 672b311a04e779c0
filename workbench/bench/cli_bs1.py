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

import pandas as pd

from workbench.bench import cli_args as args
from workbench.bench.cli_output import finish, json_records, print_choices, run_choices, show, stamp


def bench_spec(ns: argparse.Namespace) -> int:
    from workbench.bench.sanity import mark
    from workbench.bench.spec import ceiling_lines, dtype_effect, dtype_effect_line, run_spec_bench
    from workbench.config import SpecConfig

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
    finally:
        engine.close()
    flags = res.flags()
    show("EAGLE-3 vs baseline, bs=1, greedy", mark(res.summary, flags))
    for line in ceiling_lines(res.summary):
        print(line)
    if mon is not None:
        print(f"thread count: {len(mon.log)} re-measurement(s) during the run, "
              f"{mon.recalibrations} drift(s) on a quiet machine re-calibrated without one")
    extra = {"engine_choices": choices}
    if effect is not None:
        print(dtype_effect_line(effect))
        extra["dtype_effect"] = effect
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
    tok_a = Path(assistant or "") / "tokenizer.json"
    tok_t = Path(model_path) / "tokenizer.json"
    if assistant and (not tok_a.is_file() or not tok_t.is_file()
                      or tok_a.read_bytes() != tok_t.read_bytes()):
        print(f"peers: {assistant} has another tokenizer than the target; "
              "the assisted arm is left out")
        return None
    return assistant


def bench_peers(ns: argparse.Namespace) -> int:
    from workbench.bench.peers import run_peers
    from workbench.bench.sanity import LoadSampler, mark, sanity_flags

    shape = args.spec(ns)
    repeats = args.repeats(ns)
    prompts = args.prompts(ns)
    engine = args.engine(ns, need_draft=False)
    try:
        spec = shape if engine.runner.draft is not None else None
        assistant = _assistant(ns, engine.model_path)
        print_choices(engine)
        with LoadSampler() as load:
            rows, summary, machine = run_peers(
                engine, prompts, max_new_tokens=args.max_new(ns), spec=spec,
                assistant=assistant, repeats=repeats, compiled=not getattr(ns, "quick", False))
        choices = run_choices(engine)
    finally:
        engine.close()
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
    stamp(out / "peers.json", flags, load.as_dict(), {"engine_choices": choices}, "peers",
          summary)
    print(f"\nresults: {out / 'peers.json'}")
    return finish(ns, True, flags)


def bench_shapes(ns: argparse.Namespace) -> int:
    from workbench.bench.sanity import LoadSampler, mark, sanity_flags
    from workbench.bench.shapes import (
        SHAPES,
        check_tau,
        run_shapes,
        save_shapes,
        trained_vs_random,
    )

    tau = float(ns.tau)
    spec = args.spec(ns)
    check_tau(tau, spec)  # before anything is loaded
    prompts = args.prompts(ns)
    shapes = dict(list(SHAPES.items())[:2]) if ns.quick else SHAPES
    pairs = {}
    if ns.draft and (Path(ns.draft) / "config.json").is_file():
        pairs["shipped (trained)"] = (ns.model, ns.draft)
    with LoadSampler() as load:
        df = run_shapes(prompts, shapes, tau=tau, spec=spec, max_new_tokens=args.max_new(ns),
                        tokenizer_from=ns.model, pairs=pairs, repeats=args.repeats(ns),
                        engine_config=args.engine_config(ns))
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


def bench_load(ns: argparse.Namespace) -> int:
    from workbench.bench.load import run_load_bench, verdict
    from workbench.bench.sanity import LoadSampler

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
