"""docs/REFERENCE.md §2 "Layout, file by file" names every module of workbench/.

The map is where a newcomer looks for "which file does X": a module missing from it is a module
nobody finds. Each top-level entry of the map's code block (a line indented by two spaces,
``  viz/`` or ``  config.py``, with its continuation lines) must name every ``.py`` file of its
package (``__init__.py`` of a subpackage excepted); a top-level module must have its own entry.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "workbench"
REFERENCE = ROOT / "docs" / "REFERENCE.md"


def layout_entries(text: str) -> dict[str, str]:
    """Top-level name (``viz``, ``config.py``) → the text of its entry in §2's code block."""
    m = re.search(r"^## 2\. Layout, file by file\n```\n(.*?)\n```", text, re.S | re.M)
    assert m, "docs/REFERENCE.md: no '## 2. Layout, file by file' code block"
    entries: dict[str, str] = {}
    current = None
    for line in m.group(1).splitlines():
        top = re.match(r"^  (\S+)", line)
        if top:
            name = top.group(1).rstrip("/")
            current = name
            entries[current] = line
        elif current is not None:
            entries[current] += "\n" + line
    return entries


def unmapped(text: str) -> list[str]:
    entries = layout_entries(text)
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if len(rel.parts) == 1:
            if rel.name not in entries:
                missing.append(f"workbench/{rel}")
            continue
        if rel.name == "__init__.py" and len(rel.parts) > 2:
            continue  # a subpackage is named by its folder (figures/, eagle3/)
        entry = entries.get(rel.parts[0], "")
        names = [rel.name] if rel.name != "__init__.py" else []
        names += [f"{p}/" for p in rel.parts[1:-1]]
        if not entry or any(not re.search(rf"(?<![\w.]){re.escape(n)}", entry) for n in names):
            missing.append(f"workbench/{rel}")
    return missing


def test_every_module_is_on_the_map() -> None:
    missing = unmapped(REFERENCE.read_text())
    assert not missing, ("docs/REFERENCE.md §2 does not name these modules (add each to its "
                         "package's entry with what it holds): " + ", ".join(missing))


def test_the_map_reader() -> None:
    doc = ("## 2. Layout, file by file\n```\nworkbench/\n  config.py   settings\n"
           "  viz/        prose.py, figures/ (trees.py)\n             report.py\n```\n")
    entries = layout_entries(doc)
    assert set(entries) == {"config.py", "viz"}
    assert "report.py" in entries["viz"] and "trees.py" in entries["viz"]
