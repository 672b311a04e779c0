"""The speed table of README.md and docs/PERFORMANCE.md, written from data/results/.

One row per headline figure, one column per machine kind seen in the result files
(``data/results/<kind>.json`` and ``data/results/<run>/<kind>.json``, each holding the latest
``bench`` runs of one machine kind under ``benchmarks``). A cell gives the figure, its 95 %
interval where the run recorded one, the run's date, and a link to the result file; a figure a
run did not record reads "—". The table sits between two marker lines in each page::

    python scripts/readme_table.py           # print the table
    python scripts/readme_table.py --write   # rewrite it in README.md and docs/PERFORMANCE.md
    python scripts/readme_table.py --check   # exit 1 when a page's table differs

tests/test_readme_table.py fails when a page's table is not what this script writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "data" / "results"
PAGES = (ROOT / "README.md", ROOT / "docs" / "PERFORMANCE.md")
BEGIN = "<!-- speed-table:begin (scripts/readme_table.py writes this table) -->"
END = "<!-- speed-table:end -->"

Row = dict[str, Any]
Figure = tuple[float, float | None, float | None]  # value, 95 % interval low, high


@dataclass(frozen=True)
class Headline:
    """One row: which result file of a kind (``folder`` under data/results, "" for the top
    level), which benchmark in it, how to read the figure from its summary rows, the unit, and
    the command that measures it."""

    label: str
    folder: str
    bench: str
    read: Callable[[list[Row]], Figure | None]
    unit: str
    command: str


def _one(rows: list[Row], **match: Any) -> Row | None:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) > 1:
        raise ValueError(f"more than one summary row matches {match}")
    return found[0] if found else None


def ratio(column: str, **match: Any) -> Callable[[list[Row]], Figure | None]:
    """``column`` of the one row matching ``match``, with ``column_lo``/``column_hi``."""
    def read(rows: list[Row]) -> Figure | None:
        r = _one(rows, **match)
        if r is None or r.get(column) is None:
            return None
        return float(r[column]), r.get(f"{column}_lo"), r.get(f"{column}_hi")
    return read


def goal(prefix: str) -> Callable[[list[Row]], Figure | None]:
    """A ``bench load`` goal row's figure (its goal text starts with ``prefix``)."""
    def read(rows: list[Row]) -> Figure | None:
        found = [r for r in rows if str(r.get("goal") or "").startswith(prefix)]
        return (float(found[0]["figure"]), None, None) if found else None
    return read


HEADLINES = (
    Headline("workbench baseline / HF `generate`, bs=1", "", "peers",
             ratio("vs_hf_generate", arm="workbench"), "×",
             "bench peers --prompts 4 --max-new-tokens 64 --repeats 4"),
    Headline("EAGLE-3 / HF `generate`, bs=1", "", "peers",
             ratio("vs_hf_generate", arm="workbench eagle3"), "×", "same"),
    Headline("EAGLE-3 S5K4N16 / own baseline, bs=1, 64 new tokens", "", "spec",
             ratio("speedup", arm="tree S5 K4 N16"), "×",
             "bench spec --prompts 8 --max-new-tokens 64 --repeats 3"),
    Headline("EAGLE-3 S5K4N16 / own baseline, bs=1, 256 new tokens", "spec_bs1_256", "spec",
             ratio("speedup", arm="tree S5 K4 N16"), "×",
             "bench spec --max-new-tokens 256 --repeats 3"),
    Headline("S5K4N16 step / its per-step ceiling, bs=1", "", "spec",
             ratio("of_ceiling_step", arm="tree S5 K4 N16"), "",
             "bench spec (as above)"),
    Headline("K=0 tax, `BatchThreshold(0)`, c=1", "", "k0",
             ratio("k0_tax_pct", arm="k0 default (auto)", concurrency=1), " %",
             "bench k0 --levels 1,2,4,8,16,32,64 --prompts 8 --max-new-tokens 64 --repeats 2"),
    Headline("Goodput / envelope, c=64", "", "concurrency",
             ratio("vs_baseline", arm="goodput", concurrency=64), "",
             "bench concurrency --levels 1,4,16,64 --max-new-tokens 64"),
    Headline("baseline beside one CPU-bound process / alone, bs=1", "", "load",
             goal("baseline tok/s competing / alone"), "",
             "bench load --prompts 4 --max-new-tokens 64 --repeats 3"),
    Headline("wb-moe: EAGLE-3 / HF `generate`, bs=1", "wb-moe", "peers",
             ratio("vs_hf_generate", arm="workbench eagle3"), "×",
             "bench peers --model data/models/wb-moe --draft data/models/wb-moe-eagle3 --quick "
             "--repeats 3"),
)


def result_files() -> dict[tuple[str, str], Path]:
    """(folder, machine kind) → result file, for every ``<kind>.json`` holding benchmarks."""
    found: dict[tuple[str, str], Path] = {}
    for path in sorted(list(RESULTS.glob("*.json")) + list(RESULTS.glob("*/*.json"))):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "benchmarks" not in data:
            continue
        kind = data["machine"]["kind"]
        if path.stem != kind:
            raise ValueError(f"{path.relative_to(ROOT)}: machine.kind is {kind!r}, the file "
                             "name says otherwise")
        folder = "" if path.parent == RESULTS else path.parent.name
        found[(folder, kind)] = path
    return found


def machine_label(path: Path) -> str:
    m = json.loads(path.read_text())["machine"]
    fam = f" family {m['family']}" if m.get("family") is not None else ""
    cpu = str(m["cpu"]).split(" (")[0]
    return f"{cpu}{fam}, {m['cores']} cores"


def _num(x: float, unit: str) -> str:
    return f"{x:.1f}" if unit == " %" else f"{x:.2f}"


def cell(h: Headline, path: Path | None, link_base: str) -> str:
    if path is None:
        return "—"
    bench = json.loads(path.read_text())["benchmarks"].get(h.bench)
    if bench is None:
        return "—"
    fig = h.read(bench["summary"])
    if fig is None:
        return "—"
    value, lo, hi = fig
    text = f"**{_num(value, h.unit)}{h.unit}**"
    if lo is not None and hi is not None and lo != hi:
        text += f" ({_num(float(lo), h.unit)}–{_num(float(hi), h.unit)})"
    else:
        text += " (no interval recorded)"
    date = str(bench.get("time") or "")[:10] or "date not recorded"
    if bench.get("flags"):
        date += ", flagged: " + ", ".join(bench["flags"])
    rel = path.relative_to(ROOT).as_posix()
    return f"{text}, {date}, [result]({link_base}{rel})"


def table(link_base: str = "") -> str:
    """The table as Markdown; links are ``link_base`` + the path from the repository root."""
    files = result_files()
    kinds = sorted({k for _, k in files})
    cells = {h: {k: cell(h, files.get((h.folder, k)), link_base) for k in kinds}
             for h in HEADLINES}
    # a row per headline figure some kind recorded, a column per kind with a figure
    rows = [h for h in HEADLINES if any(c != "—" for c in cells[h].values())]
    kinds = [k for k in kinds if any(cells[h][k] != "—" for h in rows)]
    labels = {k: machine_label(files.get(("", k)) or next(p for (_, kk), p in files.items()
                                                          if kk == k)) for k in kinds}
    head = ["figure", *(f"{labels[k]} (`{k}`)" for k in kinds), "command"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for h in rows:
        cmd = h.command if h.command in ("same", "bench spec (as above)") else f"`{h.command}`"
        lines.append("| " + " | ".join([h.label, *(cells[h][k] for k in kinds), cmd]) + " |")
    return "\n".join(lines) + "\n"


def link_base(page: Path) -> str:
    return "../" * (len(page.relative_to(ROOT).parts) - 1)


def block(page: Path) -> str:
    """The marked block of ``page`` (markers included); ValueError when the markers are not
    there exactly once each."""
    text = page.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{page.relative_to(ROOT)}: needs the speed-table markers once each")
    a = text.index(BEGIN)
    return text[a:text.index(END) + len(END)]


def expected_block(page: Path) -> str:
    return f"{BEGIN}\n{table(link_base(page))}{END}"


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the pages' tables")
    ap.add_argument("--check", action="store_true", help="exit 1 when a page's table differs")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if not (args.write or args.check):
        sys.stdout.write(table())
        return 0
    stale = []
    for page in PAGES:
        have, want = block(page), expected_block(page)
        if have == want:
            continue
        stale.append(page.relative_to(ROOT).as_posix())
        if args.write:
            page.write_text(page.read_text().replace(have, want))
    if stale:
        print(("rewrote: " if args.write else "stale: ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
