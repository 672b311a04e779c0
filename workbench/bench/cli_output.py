"""``python -m workbench bench``: printing and saving what a benchmark measured.

Tables, the engine's measured choices, the machine/load/flags stamp on every saved JSON (and the
merge into the machine kind's results file, ``workbench.bench.results``), the flags read back
from a saved sweep, and the exit code (``--strict``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pandas as pd

# the running command line (set by ``workbench.bench.cli.run``), for the per-machine results file
COMMAND: dict[str, str] = {}


def show(title: str, df: pd.DataFrame) -> None:
    print(f"\n{title}")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.2f}"))


def print_choices(engine: Any) -> dict[str, Any]:
    """The engine's measured / forced choices (``Engine.choices``), printed once."""
    ch = dict(getattr(engine, "choices", None) or {})
    if ch:
        shown = [f"{k}={v.get('choice', v) if isinstance(v, dict) else v}"
                 for k, v in ch.items()]
        print("engine choices: " + ", ".join(shown))
    return ch


def json_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return list(json.loads(df.to_json(orient="records")))


def stamp(json_path: Path, flags: list[Any], load: dict[str, Any] | None,
          extra: dict[str, Any] | None = None, bench: str | None = None,
          summary: pd.DataFrame | None = None) -> None:
    """Add machine, load, flags (and ``extra``, e.g. the engine's choices) to a saved JSON;
    with ``bench`` and ``summary`` also merge them into the machine kind's results file
    (``workbench.bench.results``: ``<out>/<kind>.json``)."""
    from workbench.bench import results
    from workbench.bench.sanity import report
    from workbench.machine import machine_info

    doc = json.loads(json_path.read_text()) if json_path.is_file() else {}
    machine = doc.get("machine") or machine_info()
    rep = report(flags, load, machine)
    doc.update(rep)
    doc.update(extra or {})
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if bench is not None and summary is not None:
        path = results.record(json_path.parent, bench, json_records(summary), rep,
                              command=COMMAND.get("line"),
                              extra={"engine_choices": (extra or {}).get("engine_choices")})
        print(f"machine results: {path} [{bench}]")


def saved_flags(df: pd.DataFrame) -> list[Any]:
    """The flags ``save_results`` wrote (and the ``flags`` column it added) back into ``df``."""
    from workbench.bench.sanity import Flag

    saved = Path(df.attrs["saved"])
    doc = json.loads(saved.read_text())
    marked = pd.read_csv(saved.with_suffix(".csv"), keep_default_na=False)
    df["flags"] = marked["flags"].tolist()
    return [Flag(f["code"], f["message"], f["row"]) for f in doc.get("flags", [])]


def finish(ns: argparse.Namespace, ok: bool, flags: list[Any]) -> int:
    """Print the flags; the exit code (2: flagged under ``--strict``)."""
    from workbench.bench.sanity import exit_code, print_flags

    print_flags(flags)
    code = exit_code(ok, flags, bool(getattr(ns, "strict", False)))
    if code == 2:
        print("--strict: the run is flagged; exit 2")
    return code
