"""``python -m workbench bench {spec,peers,concurrency,threshold,shapes}``: run, print, save.

* spec: EAGLE-3 arms vs baseline at bs=1 (``workbench.bench.spec``);
* peers: transformers generate / prompt lookup / assisted vs ours (``workbench.bench.peers``);
* concurrency: closed-loop sweep over concurrency levels with the policy arms
  (``workbench.bench.concurrency``), or against a running server with ``--url``
  (``workbench.bench.http``);
* threshold: baseline vs eagle3 sweep → crossover batch size and a suggested BatchThreshold(n);
* k0: the K=0 tax of the default SpecConfig (BatchThreshold(0) vs baseline, interleaved);
* shapes: speedup vs target shape at a simulated accept length, random-weight pairs
  (``workbench.bench.shapes``): which pair shape this machine needs for a given speedup.

Prompts come from ``data/prompts/heldout.jsonl`` (``python -m workbench make-prompts``).

Every result records the machine (``workbench.bench.machine``), the load average before and
after, and the sanity flags of ``workbench.bench.sanity`` (load > cores, self-inconsistent
numbers); flagged rows carry the flag codes in a ``flags`` column, and ``--strict`` makes a
flagged run exit 2. ``--repeats`` adds 95 % confidence intervals; ``--engine KEY=VALUE,...``
forces EngineConfig fields (e.g. ``gemm=dense``) instead of the measured "auto" choices, whose
outcome (``Engine.choices``) is printed and saved with the results.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.errors import ConfigError

QUICK_LEVELS = (1, 4, 16)


def _prompts(ns: argparse.Namespace) -> list[str]:
    from workbench.bench.workloads import PROMPTS_DIR, load_prompts

    path = PROMPTS_DIR / "heldout.jsonl"
    if not path.is_file():
        raise ConfigError(f"bench: no prompts at {path}; write them first with "
                          "`python -m workbench make-prompts`")
    limit = min(ns.prompts, 4) if ns.quick else ns.prompts
    prompts = [p.prompt for p in load_prompts(limit=limit)]
    if not prompts:
        raise ConfigError(f"bench: {path} holds no prompts; rerun "
                          "`python -m workbench make-prompts`")
    return prompts


def _engine_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """``--engine gemm=dense,threads=2`` → {"gemm": "dense", "threads": 2} (errors name the
    flag and the field)."""
    from workbench.config import EngineConfig

    raw = str(getattr(ns, "engine", "") or "").strip()
    out: dict[str, Any] = {}
    if not raw:
        return out
    fields = EngineConfig.__dataclass_fields__
    for part in raw.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            raise ConfigError(f"--engine: {part!r} is not KEY=VALUE with KEY an EngineConfig "
                              f"field ({', '.join(sorted(fields))})")
        v: Any = value.strip()
        default = getattr(EngineConfig(), key)
        if isinstance(default, bool):
            if v.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ConfigError(f"--engine {key}: expected true/false, got {value!r}")
            v = v.lower() in ("true", "1", "on")
        elif isinstance(default, int) or key in ("max_model_len",):
            try:
                v = int(v)
            except ValueError:
                raise ConfigError(f"--engine {key}: expected an integer, got {value!r}") from None
        out[key] = v
    return out


def _engine(ns: argparse.Namespace, need_draft: bool, max_batch: int = 64,
            kv_budget_tokens: int | None = None) -> Any:
    import workbench as wb

    target = Path(ns.model)
    if not (target / "config.json").is_file():
        raise ConfigError(f"bench: no target model at {target} (train one with "
                          "`python -m workbench train-target`, or pass --model)")
    draft = Path(ns.draft) if ns.draft else None
    if draft is not None and not (draft / "config.json").is_file():
        if need_draft:
            raise ConfigError(f"bench {ns.which}: no draft model at {draft} (train one with "
                              "`python -m workbench train-draft`, or pass --draft)")
        print(f"note: no draft at {draft}; running the baseline only")
        draft = None
    cfg = wb.EngineConfig(max_batch_size=max(64, max_batch))
    over = _engine_overrides(ns)
    if over:
        cfg = dataclasses.replace(cfg, **over)
    if kv_budget_tokens is not None:
        cfg = dataclasses.replace(cfg, kv_budget_tokens=kv_budget_tokens)
    return wb.Engine.from_pretrained(target, draft=draft, config=cfg)


def _spec(ns: argparse.Namespace) -> Any:
    """``--spec S,K,N`` → SpecConfig (errors name the flag)."""
    from workbench.config import SpecConfig

    parts = str(getattr(ns, "spec", "5,4,16")).split(",")
    try:
        s, k, n = (int(x) for x in parts)
    except ValueError:
        raise ConfigError(f"--spec: expected three integers S,K,N, got {ns.spec!r}") from None
    try:
        return SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
    except ConfigError as e:
        raise ConfigError(f"--spec {ns.spec}: {e}") from e


def _repeats(ns: argparse.Namespace) -> int:
    r = getattr(ns, "repeats", 1)
    if not isinstance(r, int) or r < 1:
        raise ConfigError(f"--repeats: must be an integer >= 1, got {r!r}")
    return r


def _show(title: str, df: pd.DataFrame) -> None:
    print(f"\n{title}")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.2f}"))


def _choices(engine: Any) -> dict[str, Any]:
    """The engine's measured / forced choices (``Engine.choices``), printed once."""
    ch = dict(getattr(engine, "choices", None) or {})
    if ch:
        shown = [f"{k}={v.get('choice', v) if isinstance(v, dict) else v}"
                 for k, v in ch.items()]
        print("engine choices: " + ", ".join(shown))
    return ch


def _stamp(json_path: Path, flags: list[Any], load: dict[str, Any] | None,
           extra: dict[str, Any] | None = None, bench: str | None = None,
           summary: pd.DataFrame | None = None) -> None:
    """Add machine, load, flags (and ``extra``, e.g. the engine's choices) to a saved JSON;
    with ``bench`` and ``summary`` also merge them into the machine kind's results file
    (``workbench.bench.results``: ``<out>/<kind>.json``)."""
    import json

    from workbench.bench import results
    from workbench.bench.machine import machine_info
    from workbench.bench.sanity import report

    doc = json.loads(json_path.read_text()) if json_path.is_file() else {}
    machine = doc.get("machine") or machine_info()
    rep = report(flags, load, machine)
    doc.update(rep)
    doc.update(extra or {})
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if bench is not None and summary is not None:
        path = results.record(json_path.parent, bench, json_records(summary), rep,
                              command=_COMMAND.get("line"),
                              extra={"engine_choices": (extra or {}).get("engine_choices")})
        print(f"machine results: {path} [{bench}]")


def _finish(ns: argparse.Namespace, ok: bool, flags: list[Any]) -> int:
    from workbench.bench.sanity import exit_code, print_flags

    print_flags(flags)
    code = exit_code(ok, flags, bool(getattr(ns, "strict", False)))
    if code == 2:
        print("--strict: the run is flagged; exit 2")
    return code


def _levels(ns: argparse.Namespace) -> tuple[int, ...]:
    from workbench.bench.concurrency import LEVELS

    raw = getattr(ns, "levels", None)
    if raw is None:
        return QUICK_LEVELS if ns.quick else LEVELS
    try:
        levels = tuple(int(x) for x in str(raw).split(","))
    except ValueError:
        raise ConfigError(f"--levels: expected comma-separated integers, got {raw!r}") from None
    if not levels or min(levels) < 1:
        raise ConfigError(f"--levels: concurrency levels must be >= 1, got {raw!r}")
    return levels


def _max_new(ns: argparse.Namespace) -> int:
    return min(ns.max_new_tokens, 32) if ns.quick else ns.max_new_tokens


def bench_spec(ns: argparse.Namespace) -> int:
    from workbench.bench.sanity import mark
    from workbench.bench.spec import run_spec_bench
    from workbench.config import SpecConfig

    prompts = _prompts(ns)
    repeats = _repeats(ns)
    engine = _engine(ns, need_draft=False)
    try:
        choices = _choices(engine)
        arms: dict[str, SpecConfig | None] | None = \
            None if engine.draft is not None else {"baseline": None}
        res = run_spec_bench(engine, prompts, arms=arms, max_new_tokens=_max_new(ns),
                             repeats=repeats, bound=engine.draft is not None)
    finally:
        engine.close()
    flags = res.flags()
    _show("EAGLE-3 vs baseline, bs=1, greedy", mark(res.summary, flags))
    path = res.save(ns.out)
    _stamp(path, flags, res.machine.get("load"), {"engine_choices": choices}, "spec",
           mark(res.summary, flags))
    print(f"\nresults: {path}")
    return _finish(ns, bool(res.summary["lossless"].all()), flags)


def bench_peers(ns: argparse.Namespace) -> int:
    import json

    from workbench.bench.peers import run_peers
    from workbench.bench.sanity import LoadSampler, mark, sanity_flags

    shape = _spec(ns)
    repeats = _repeats(ns)
    prompts = _prompts(ns)
    engine = _engine(ns, need_draft=False)
    try:
        spec = shape if engine.draft is not None else None
        assistant = getattr(ns, "assistant", None)
        if assistant and not (Path(assistant) / "config.json").is_file():
            assistant = None  # no small draft LM shipped: the assisted arm is left out
        tok_a = Path(assistant or "") / "tokenizer.json"
        tok_t = Path(engine.model_path) / "tokenizer.json"
        if assistant and (not tok_a.is_file() or not tok_t.is_file()
                          or tok_a.read_bytes() != tok_t.read_bytes()):
            print(f"peers: {assistant} has another tokenizer than the target; "
                  "the assisted arm is left out")
            assistant = None
        choices = _choices(engine)
        with LoadSampler() as load:
            rows, summary, machine = run_peers(
                engine, prompts, max_new_tokens=_max_new(ns), spec=spec, assistant=assistant,
                repeats=repeats, compiled=not getattr(ns, "quick", False))
    finally:
        engine.close()
    flags = sanity_flags(summary, load=load.as_dict())
    summary = mark(summary, flags)
    _show("peers, bs=1, greedy (ratios vs hf generate; startup_s: first call incl. compile)",
          summary)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out / "peers_per_prompt.csv", index=False)
    summary.to_csv(out / "peers.csv", index=False)
    (out / "peers.json").write_text(json.dumps(
        {"machine": machine, "spec": ns.spec if spec is not None else None,
         "summary": json.loads(summary.to_json(orient="records"))},
        indent=2) + "\n")
    _stamp(out / "peers.json", flags, load.as_dict(), {"engine_choices": choices}, "peers",
           summary)
    print(f"\nresults: {out / 'peers.json'}")
    return _finish(ns, True, flags)


def _arm_engines(ns: argparse.Namespace, engine: Any, arms: dict[str, Any],
                 prompts: list[str], levels: tuple[int, ...]) -> dict[str, Any]:
    """One engine per arm (interleaved sweep), unless ``--sequential``. Every arm is then timed
    on the same stretch of the machine's life; the pools are sized for the sweep, since up to
    seven engines share the memory."""
    if getattr(ns, "sequential", False) or len(arms) < 2:
        return {}
    longest = max(len(engine.tokenize(p)) for p in prompts)
    need = max(levels) * (longest + _max_new(ns) + 2 * engine.config.page_size + 64)
    engines: dict[str, Any] = {}
    try:
        for a in arms:
            engines[a] = _engine(ns, need_draft=engine.draft is not None, max_batch=max(levels),
                                 kv_budget_tokens=need)
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines


def _sweep(ns: argparse.Namespace, prompts: list[str], levels: tuple[int, ...],
           arms: Callable[[Any], dict[str, Any]], *, need_draft: bool,
           name: str) -> tuple[Any, dict[str, Any]]:
    """One concurrency sweep: a reference engine, one engine per arm (``_arm_engines``), every
    engine closed afterwards. ``arms(engine)`` names the arms. Returns the frame and the
    reference engine's measured choices."""
    from workbench.bench.concurrency import run_concurrency

    engine = _engine(ns, need_draft=need_draft, max_batch=max(levels))
    engines: dict[str, Any] = {}
    try:
        choices = _choices(engine)
        arm_map = arms(engine)
        engines = _arm_engines(ns, engine, arm_map, prompts, levels)
        df = run_concurrency(engine, prompts, levels=levels, arms=arm_map,
                             max_new_tokens=_max_new(ns), out=ns.out, name=name,
                             repeats=_repeats(ns), engines=engines or None)
    finally:
        engine.close()
        for e in engines.values():
            e.close()
    return df, choices


def bench_concurrency(ns: argparse.Namespace) -> int:
    levels = _levels(ns)  # flag errors first, whichever path
    if ns.url:
        return bench_http(ns)
    from workbench.bench.concurrency import (
        default_arms,
        find_threshold,
        summarize,
        switch_costs,
    )

    shape = _spec(ns)
    prompts = _prompts(ns)
    df, choices = _sweep(ns, prompts, levels,
                         lambda engine: default_arms(engine, spec=shape, flips=True),
                         need_draft=False, name="concurrency")
    cols = ["arm", "concurrency", "tok_s", "tok_s_lo", "tok_s_hi", "vs_baseline",
            "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
            "itl_p99_ms", "tau", "spec_share", "lossless", "flags"]
    flags = _saved_flags(df)
    s = summarize(df)
    _show("closed-loop concurrency sweep (greedy)", s[[c for c in cols if c in s]])
    never = s[s["arm"] == "never"]
    if not never.empty:
        _show("K=0 tax (never vs baseline): whole-run tok/s and per steady-state step",
              never[["concurrency", "k0_tax", "k0_tax_step"]])
    sc = switch_costs(df)
    if not sc.empty:
        _show("cost per switch: warm vs cold draft (RandomFlip p=0.5)", sc)
    if {"baseline", "eagle3"} <= set(s["arm"]):
        th = find_threshold(df)
        print(f"\ncrossover: {th.crossover} · suggested BatchThreshold({th.suggested_n})")
    _stamp(Path(df.attrs["saved"]), flags, df.attrs.get("load"), {"engine_choices": choices},
           "concurrency", s[[c for c in [*cols, "k0_tax", "k0_tax_step"] if c in s]])
    print(f"\nresults: {df.attrs.get('saved')}")
    lossless = s["lossless"].dropna()
    return _finish(ns, bool(lossless.all()), flags)


def _saved_flags(df: pd.DataFrame) -> list[Any]:
    """The flags ``save_results`` wrote (and the ``flags`` column it added) back into ``df``."""
    import json

    from workbench.bench.sanity import Flag

    saved = Path(df.attrs["saved"])
    doc = json.loads(saved.read_text())
    marked = pd.read_csv(saved.with_suffix(".csv"), keep_default_na=False)
    df["flags"] = marked["flags"].tolist()
    return [Flag(f["code"], f["message"], f["row"]) for f in doc.get("flags", [])]


def bench_http(ns: argparse.Namespace) -> int:
    """Closed-loop sweep against a running server (ours or SGLang), one level at a time."""
    import json

    from workbench.bench import http
    from workbench.bench.machine import loadavg, machine_info
    from workbench.bench.sanity import LoadSampler, mark, sanity_flags

    prompts = _prompts(ns)
    rows = []
    with LoadSampler() as load:
        for c in _levels(ns):
            n = max(2 * c, len(prompts))
            plist = [prompts[i % len(prompts)] for i in range(n)]
            before = loadavg()
            res = http.run_http_bench(ns.url, plist, concurrency=c,
                                      max_new_tokens=_max_new(ns))
            after = loadavg()
            print(http.format_table(res))
            rows.append({k: v for k, v in res.items() if k != "requests"}
                        | {"load_before": before[0] if before else None,
                           "load_after": after[0] if after else None})
    df = pd.DataFrame(rows)
    # the server may run on another machine: only the client-side load is known here
    view = df.rename(columns={"output_throughput": "tok_s", "p50_itl_ms": "itl_p50_ms",
                              "accept_length": "tau"})
    flags = sanity_flags(view[[c for c in ("concurrency", "tok_s", "itl_p50_ms", "tau",
                                           "load_before", "load_after") if c in view]],
                         load=load.as_dict())
    df = mark(df, flags)
    cols = ["concurrency", "completed", "failed", "output_throughput", "p50_ttft_ms",
            "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms",
            "accept_length"]
    _show(f"HTTP closed-loop sweep against {ns.url}", df[[c for c in cols if c in df]])
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    df.drop(columns=["errors"], errors="ignore").to_csv(out / "concurrency_http.csv", index=False)
    rows_json = json.loads(df.to_json(orient="records"))
    (out / "concurrency_http.json").write_text(json.dumps(
        {"machine": machine_info(), "url": ns.url, "rows": rows_json}, indent=2) + "\n")
    _stamp(out / "concurrency_http.json", flags, load.as_dict(), None, "concurrency_http",
           df.drop(columns=["errors"], errors="ignore"))
    print(f"\nresults: {out / 'concurrency_http.json'}")
    return _finish(ns, int(df["failed"].sum()) == 0, flags)


def bench_threshold(ns: argparse.Namespace) -> int:
    if ns.url:  # on the box: --url BASELINE_URL,EAGLE3_URL (workbench.remote.box)
        from workbench.remote.box import sweep_threshold

        sweep_threshold(ns.url, _prompts(ns), _levels(ns), _max_new(ns), ns.out)
        return 0
    from workbench.bench.concurrency import find_threshold

    levels = _levels(ns)
    shape = _spec(ns)
    prompts = _prompts(ns)
    df, choices = _sweep(ns, prompts, levels, lambda _: {"baseline": None, "eagle3": shape},
                         need_draft=True, name="threshold")
    flags = _saved_flags(df)
    th = find_threshold(df)
    _show("baseline vs eagle3 output tok/s by concurrency", th.table)
    where = "never (eagle3 wins at every level)" if th.crossover is None else \
        f"at concurrency {th.crossover}"
    print(f"\nbaseline catches up {where}; suggested BatchThreshold({th.suggested_n})")
    _stamp(Path(df.attrs["saved"]), flags, df.attrs.get("load"), {"engine_choices": choices},
           "threshold", th.table)
    print(f"results: {df.attrs.get('saved')}")
    return _finish(ns, True, flags)


def bench_shapes(ns: argparse.Namespace) -> int:
    from workbench.bench.shapes import SHAPES, check_tau, run_shapes, save_shapes

    tau = float(ns.tau)
    spec = _spec(ns)
    check_tau(tau, spec)  # before anything is loaded
    prompts = _prompts(ns)
    shapes = dict(list(SHAPES.items())[:2]) if ns.quick else SHAPES
    pairs = {}
    if ns.draft and (Path(ns.draft) / "config.json").is_file():
        pairs["shipped (trained)"] = (ns.model, ns.draft)
    from workbench.bench.sanity import LoadSampler, mark, sanity_flags

    with LoadSampler() as load:
        df = run_shapes(prompts, shapes, tau=tau, spec=spec, max_new_tokens=_max_new(ns),
                        tokenizer_from=ns.model, pairs=pairs, repeats=_repeats(ns),
                        engine_config=_engine_config(ns))
    flags = sanity_flags(df, load=load.as_dict())
    df = mark(df, flags)
    _show(f"speedup vs target shape at a simulated accept length (random weights; "
          f"{df.attrs['config']['spec']}, bs=1 greedy)",
          df.drop(columns=["layers", "hidden", "random"]))
    path = save_shapes(df, ns.out)
    _stamp(path, flags, load.as_dict(), None, "shapes", df)
    print(f"\nresults: {path}")
    return _finish(ns, True, flags)


def _engine_config(ns: argparse.Namespace) -> Any:
    """EngineConfig with the ``--engine`` overrides (None when there are none)."""
    import workbench as wb

    over = _engine_overrides(ns)
    return dataclasses.replace(wb.EngineConfig(), **over) if over else None


def bench_k0(ns: argparse.Namespace) -> int:
    """K=0 tax of the *default* SpecConfig: ``BatchThreshold(0)`` (a speculative engine that
    never drafts) vs the baseline, side by side (interleaved), per concurrency level; the same
    with ``draft_state="warm"`` for comparison. Goal: ≤ 2 % at every level with the default."""
    from workbench.bench.concurrency import summarize
    from workbench.config import SpecConfig
    from workbench.speculative.policy import BatchThreshold

    levels = _levels(ns)
    shape = _spec(ns)
    prompts = _prompts(ns)
    default_state = SpecConfig().draft_state
    arms: dict[str, Any] = {
        "baseline": None,
        f"k0 default ({default_state})": dataclasses.replace(shape, policy=BatchThreshold(0)),
        "k0 warm": dataclasses.replace(shape, policy=BatchThreshold(0), draft_state="warm"),
    }
    df, choices = _sweep(ns, prompts, levels, lambda _: arms, need_draft=True, name="k0_tax")
    flags = _saved_flags(df)
    s = summarize(df)
    s["k0_tax_pct"] = 100.0 * (1.0 - s["vs_baseline"])
    step = s[s["arm"] == "baseline"].set_index("concurrency")["steady_step_ms"]
    s["k0_tax_step_pct"] = 100.0 * (s["steady_step_ms"] / s["concurrency"].map(step) - 1.0)
    cols = ["arm", "concurrency", "tok_s", "tok_s_lo", "tok_s_hi", "vs_baseline",
            "k0_tax_pct", "k0_tax_step_pct", "lossless", "flags"]
    _show("K=0 tax: BatchThreshold(0) vs baseline (interleaved; default draft_state "
          f"{default_state!r} and 'warm')", s[[c for c in cols if c in s]])
    _stamp(Path(df.attrs["saved"]), flags, df.attrs.get("load"),
           {"engine_choices": choices, "default_draft_state": default_state},
           "k0", s[[c for c in cols if c in s]])
    print(f"\nresults: {df.attrs.get('saved')}")
    lossless = s["lossless"].dropna()
    return _finish(ns, bool(lossless.all()), flags)


def json_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    import json

    return list(json.loads(df.to_json(orient="records")))


COMMANDS = {"spec": bench_spec, "peers": bench_peers, "concurrency": bench_concurrency,
            "threshold": bench_threshold, "shapes": bench_shapes, "k0": bench_k0}


_COMMAND: dict[str, str] = {}  # the running command line, for the per-machine results file


def command_of(ns: argparse.Namespace) -> str:
    """``python -m workbench bench <which> --flag value ...``: the flags that differ from the
    parser's defaults (what the user typed, in a canonical order)."""
    import shlex

    from workbench.__main__ import build_parser

    defaults = vars(build_parser().parse_args(["bench", ns.which]))
    parts = ["python -m workbench bench", ns.which]
    for key, value in vars(ns).items():
        if key in ("which", "fn", "cmd") or key not in defaults or value == defaults[key]:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is not False and value is not None:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m workbench bench``: dispatch on ``ns.which``."""
    if ns.which not in COMMANDS:
        raise ConfigError(f"bench: unknown benchmark {ns.which!r} (one of {sorted(COMMANDS)})")
    _COMMAND["line"] = command_of(ns)
    return COMMANDS[ns.which](ns)
