"""One results file per machine kind: ``data/results/<kind>.json`` (``kind`` from the CPU model,
``workbench.machine.machine_kind``: ``amd-epyc-family-26``, ``intel-xeon-platinum-8581c``...).

Every ``bench`` run merges its summary into the file of the machine it ran on, under the
benchmark's name, with the exact command, the machine facts, the load before/after and the
sanity flags — so figures from different kinds of machine sit side by side and never overwrite
each other, and the README and model cards can quote each figure with its machine and command.
The raw tables of the latest run stay in ``<out>/<bench>.csv/json`` as before.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from workbench.machine import machine_info, machine_kind


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as a user would type it (``python -m workbench ...``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return "python -m workbench " + " ".join(shlex.quote(a) for a in args)


def machine_file(folder: str | Path, machine: dict[str, Any] | None = None) -> Path:
    """``<folder>/<kind>.json`` for this (or the given) machine."""
    m = machine or machine_info()
    return Path(folder) / f"{m.get('kind') or machine_kind(m.get('cpu'), m.get('family'))}.json"


def record(folder: str | Path, bench: str, summary: list[dict[str, Any]],
           report: dict[str, Any], command: str | None = None,
           extra: dict[str, Any] | None = None) -> Path:
    """Merge one benchmark's ``summary`` rows (with ``report`` = machine / load / flags from
    ``workbench.bench.sanity.report``) into ``<folder>/<kind>.json`` under ``bench``."""
    machine = report.get("machine") or machine_info()
    path = machine_file(folder, machine)
    doc: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    doc["machine"] = {k: machine.get(k) for k in ("cpu", "family", "kind", "flags", "l1d", "l2",
                                                   "l3", "cores", "torch")}
    doc.setdefault("benchmarks", {})[bench] = {
        "command": command or command_line(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": machine.get("commit"), "torch_threads": machine.get("torch_threads"),
        "load": report.get("load"), "flagged": report.get("flagged"),
        "flags": [f.get("code") if isinstance(f, dict) else str(f)
                  for f in report.get("flags", [])],
        **(extra or {}), "summary": summary,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path
