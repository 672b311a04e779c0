"""``python -m workbench bench``: printing and saving what a benchmark measured.

Tables, the engine's measured choices, the machine/load/flags stamp on every saved JSON (and the
merge into the machine kind's results file, ``workbench.bench.results``), the flags read back
from a saved sweep, and the exit code (``--strict``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from workbench.bench import results
from workbench.bench.sanity import (
    Flag,
    choice_flags,
    contention_flags,
    exit_code,
    mark,
    print_flags,
    report,
)
from workbench.engine.autotune import choice_records, provisional_names
from workbench.engine.contention import measure
from workbench.machine import cpu_model, machine_info

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

# the running command line (set by ``workbench.bench.cli.run``), for the per-machine results file
COMMAND: dict[str, str] = {}
# the machine's conditions when the run started (``workbench.bench.cli.run``: Conditions dict)
RUN: dict[str, Any] = {}


def announce_conditions(window_s: float = 0.3) -> dict[str, Any]:
    """Look at the machine for ``window_s`` and print the run's first line: quiet, or busy and
    why (every figure of a busy run is provisional). Kept in :data:`RUN` for the stamps."""
    c = measure(window_s)
    RUN["conditions"] = c.to_dict()
    if c.contended:
        print(f"machine: {c.describe()} — every figure of this run is provisional; the engine "
              "adapts its thread count and caches no choice measured now")
    else:
        print(f"machine: {c.describe()}")
    return RUN["conditions"]


def show(title: str, df: pd.DataFrame) -> None:
    print(f"\n{title}")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.2f}"))


def print_choices(engine: Engine) -> dict[str, Any]:
    """The engine's measured / forced choices (``Engine.choices``), printed once, with the
    provisional ones named."""
    ch = dict(getattr(engine, "choices", None) or {})
    if ch:
        shown = [f"{k}={v.get('choice', v) if isinstance(v, dict) else v}"
                 for k, v in ch.items()]
        print("engine choices: " + ", ".join(shown))
        busy = provisional_names(ch)
        if busy:
            print(f"provisional (measured under contention, not cached): {', '.join(busy)}")
    return ch


def run_choices(engine: Engine) -> dict[str, Any]:
    """The engine's choices after a run (the contention monitor may have re-measured the
    thread count meanwhile), with its adaptations under ``"adaptations"`` when there were."""
    ch = dict(getattr(engine, "choices", None) or {})
    mon = getattr(engine, "contention", None)
    if mon is not None and mon.log:
        ch["adaptations"] = {"choice": f"{len(mon.log)} thread-count re-measurement(s)",
                             "source": "measured",
                             "provisional": any(a.conditions.get("contended") for a in mon.log),
                             "conditions": {**mon.log[-1].conditions, "cpu": cpu_model()},
                             "log": [{"reason": a.reason, "before": a.before, "after": a.after,
                                      "conditions": a.conditions} for a in mon.log]}
    return ch


def json_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return list(json.loads(df.to_json(orient="records")))


def stamp(json_path: Path, flags: list[Any], load: dict[str, Any] | None,
          extra: dict[str, Any] | None = None, bench: str | None = None,
          summary: pd.DataFrame | None = None) -> None:
    """Add machine, load, flags (and ``extra``, e.g. the engine's choices) to a saved JSON;
    with ``bench`` and ``summary`` also merge them into the machine kind's results file
    (``workbench.bench.results``: ``<out>/<kind>.json``).

    The result's conditions go with it: the run-start conditions (:data:`RUN`), and per
    engine choice where and at what load it was measured (``choices``: autotune's
    ``choice_records``). ``flags`` gains (in place, so ``finish`` and ``--strict`` see them)
    a ``contended`` flag for a busy start and a ``provisional_choice`` flag for a run on
    choices measured under contention."""
    choices = (extra or {}).get("engine_choices")
    have = {getattr(f, "code", None) for f in flags}
    flags.extend(f for f in contention_flags(RUN.get("conditions")) + choice_flags(choices)
                 if f.code not in have)
    doc = json.loads(json_path.read_text()) if json_path.is_file() else {}
    machine = doc.get("machine") or machine_info()
    rep = report(flags, load, machine)
    doc.update(rep)
    doc.update(extra or {})
    conditions = {"at_start": RUN.get("conditions"),
                  "choices": choice_records(choices or {}),
                  "provisional": provisional_names(choices or {})}
    doc["conditions"] = conditions
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if bench is not None and summary is not None:
        path = results.record(json_path.parent, bench, json_records(mark(summary, flags)), rep,
                              command=COMMAND.get("line"),
                              extra={"engine_choices": choices, "conditions": conditions})
        print(f"machine results: {path} [{bench}]")


def saved_flags(df: pd.DataFrame) -> list[Any]:
    """The flags ``save_results`` wrote (and the ``flags`` column it added) back into ``df``."""
    saved = Path(df.attrs["saved"])
    doc = json.loads(saved.read_text())
    marked = pd.read_csv(saved.with_suffix(".csv"), keep_default_na=False)
    df["flags"] = marked["flags"].tolist()
    return [Flag(f["code"], f["message"], f["row"]) for f in doc.get("flags", [])]


def finish(ns: argparse.Namespace, ok: bool, flags: list[Any]) -> int:
    """Print the flags; the exit code (2: flagged under ``--strict``)."""
    print_flags(flags)
    code = exit_code(ok, flags, bool(getattr(ns, "strict", False)))
    if code == 2:
        print("--strict: the run is flagged; exit 2")
    return code
